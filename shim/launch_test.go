package shim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLaunchReadsTheReportOfAShimThatExits: a shim that reports and exits at once (a refused restore, a
// job that cannot start) has its report read. Launch reaps the shim at once: with exec's StdoutPipe, that
// Wait closed the pipe when the shim exited, at times before its report was read, and the agent said "gave
// no report: read |0: file already closed" instead of why (in CI, ci361, TestRestoreShimRunsAsTheJobsUser).
func TestLaunchReadsTheReportOfAShimThatExits(t *testing.T) {
	dir := t.TempDir()
	self := filepath.Join(dir, "shim")
	if err := os.WriteFile(self, []byte("#!/bin/sh\necho '{\"error\": \"refused at once\"}'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	const launches = 2000 // the race lost 1 to 81 launches of 2000 here (old code, 6 runs of this test)
	lost := 0
	for range launches {
		_, err := Launch(context.Background(), self, Spec{JobID: "j-00000001"}, filepath.Join(dir, "shim.log"))
		if err == nil || !strings.Contains(err.Error(), "refused at once") {
			lost++
			if lost == 1 {
				t.Errorf("launch: %v, want the shim's report", err)
			}
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d launches lost the report of a shim that exited at once", lost, launches)
	}
}
