package shim

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
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

// TestLaunchReplacesAPlantedLog: the shim's log lies beside the job records, in jobs_dir in the default
// layout, which users may write to (sticky), named by the job's id, which the directory's listing shows. A
// file another user made there before the job's start or restore is not the log: the old code appended the
// shim's standard error (CRIU's messages about the other user's job) to it, and its owner, holding it open,
// had the agent believe a shim of the job ran (heldOpen). It is replaced by a file of root's.
func TestLaunchReplacesAPlantedLog(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to give a file to another user")
	}
	dir := t.TempDir()
	self := filepath.Join(dir, "shim")
	if err := os.WriteFile(self, []byte("#!/bin/sh\necho 'what CRIU said' >&2\necho '{\"error\": \"refused\"}'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name  string
		plant func(path string) error
	}{
		{"a file", func(p string) error { return os.WriteFile(p, nil, 0o666) }},
		{"a link", func(p string) error { return os.Symlink(filepath.Join(dir, "elsewhere"), p) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			log := filepath.Join(dir, "j-00000001.shim.log")
			os.Remove(log)
			if err := tt.plant(log); err != nil {
				t.Fatal(err)
			}
			if err := os.Lchown(log, 1000, 1000); err != nil {
				t.Fatal(err)
			}
			if _, err := Launch(context.Background(), self, Spec{JobID: "j-00000001"}, log); err == nil || !strings.Contains(err.Error(), "refused") {
				t.Fatalf("launch: %v, want the shim's report", err)
			}
			fi, err := os.Lstat(log)
			if err != nil {
				t.Fatal(err)
			}
			if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || !fi.Mode().IsRegular() {
				t.Errorf("the shim's log is uid %d's, mode %v: want a file of root's in place of the one uid 1000 planted", st.Uid, fi.Mode())
			}
			if _, err := os.Stat(filepath.Join(dir, "elsewhere")); err == nil {
				t.Errorf("the shim's log was written through the planted link")
			}
		})
	}
}
