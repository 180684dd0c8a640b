package testenv

import (
	"os"
	"testing"
)

// TestRequireKernel: under -short, and when not root, the test is skipped before anything runs; as root
// without -short it goes on.
func TestRequireKernel(t *testing.T) {
	ran := false
	// A subtest, so that its skip is observed here instead of ending this test.
	t.Run("probe", func(t *testing.T) {
		RequireKernel(t, "nothing")
		ran = true
	})
	want := !testing.Short() && os.Geteuid() == 0
	if ran != want {
		t.Errorf("short=%v root=%v: the test body ran=%v, want %v", testing.Short(), os.Geteuid() == 0, ran, want)
	}
}
