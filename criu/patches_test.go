package criu

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// The level the Go code expects is the one scripts/setup.sh builds CRIU with.
func TestPatchLevelMatchesSetup(t *testing.T) {
	out, err := exec.Command("bash", "../scripts/setup.sh", "criu-level").Output()
	if err != nil {
		t.Fatalf("scripts/setup.sh criu-level: %v", err)
	}
	got, err := strconv.ParseUint(strings.TrimSpace(string(out)), 10, 32)
	if err != nil {
		t.Fatalf("scripts/setup.sh criu-level printed %q: %v", out, err)
	}
	if uint32(got) != PatchLevel() {
		t.Fatalf("scripts/setup.sh builds CRIU with patch level %d, criu.PatchLevel() says %d", got, PatchLevel())
	}
}

func TestBinaryPatchLevel(t *testing.T) {
	want := PatchLevel()
	for _, tc := range []struct {
		name, output string
		level        uint32
	}{
		{"ftkit's build", fmt.Sprintf("Version: 4.2.1.%d\n", want), want},
		{"other patches", "Version: 4.2.1.12345\n", 12345},
		{"release", "Version: 4.2.1\n", 0},
		{"git build", "Version: 4.2.1\nGitID: v4.2.1-7-gabcdef\n", 0},
		{"not a number", "Version: 4.2.1.rc1\n", 0},
		{"no version line", "criu: unknown option\n", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bin := filepath.Join(t.TempDir(), "criu")
			script := "#!/bin/sh\nprintf '%s' '" + tc.output + "'\n"
			if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
				t.Fatal(err)
			}
			got, err := BinaryPatchLevel(bin)
			if err != nil || got != tc.level {
				t.Fatalf("BinaryPatchLevel = %d, %v; want %d", got, err, tc.level)
			}
			err = CheckPatches(bin)
			if patched := tc.level == want; patched != (err == nil) || (err != nil && !errors.Is(err, ErrUnpatched)) {
				t.Fatalf("CheckPatches = %v with level %d (want %d)", err, got, want)
			}
		})
	}
	if _, err := BinaryPatchLevel(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("BinaryPatchLevel of a missing binary: no error")
	}
}
