package testenv

import (
	"os"
	"testing"
)

// SwapForLink does what a job's user may do between a dump and a restore: moves path aside and puts a
// link to target in its place. putBack puts path back as it was.
func SwapForLink(t testing.TB, path, target string) (putBack func()) {
	t.Helper()
	if err := os.Rename(path, path+".orig"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, path); err != nil {
		t.Fatal(err)
	}
	return func() {
		t.Helper()
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".orig", path); err != nil {
			t.Fatal(err)
		}
	}
}
