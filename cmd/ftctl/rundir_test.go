package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCheckRunDirParents: root refuses a run directory under a directory another user owns or can write
// (that user could swap the launcher script mpirun runs as root), also behind a link, and accepts one under
// root's own directories and sticky ones such as /tmp.
func TestCheckRunDirParents(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: the ownership checks are root's (and chown needs root); CI runs as root")
	}
	base := t.TempDir() // under /tmp: root-owned, sticky
	mk := func(name string, mode os.FileMode, uid int) string {
		d := filepath.Join(base, name)
		if err := os.Mkdir(d, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		if err := os.Chown(d, uid, 0); err != nil {
			t.Fatal(err)
		}
		return d
	}
	good := mk("good", 0o755, 0)
	sticky := mk("sticky", 0o777|os.ModeSticky, 0)
	users := mk("users", 0o755, 65534)
	open := mk("open", 0o777, 0)
	link := filepath.Join(base, "link")
	if err := os.Symlink(users, link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dir, err string
		euid     int
	}{
		{dir: filepath.Join(good, "run")},
		{dir: filepath.Join(good, "not", "yet", "run")},
		{dir: filepath.Join(sticky, "run")},
		{dir: filepath.Join(users, "run"), err: "owned by uid 65534"},
		{dir: filepath.Join(users, "run"), euid: 1000}, // a user's own run: their rights, nothing checked
		{dir: filepath.Join(open, "x", "run"), err: "writable by group or others"},
		{dir: filepath.Join(link, "run"), err: "owned by uid 65534"},
	} {
		err := checkRunDirParents(tc.dir, tc.euid)
		if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%s (euid %d): %v, want %q", tc.dir, tc.euid, err, tc.err)
		}
	}
}

// TestWriteNewFile: a file of a new run is created, never written through something already there.
func TestWriteNewFile(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(dir, "rsh")); err != nil {
		t.Fatal(err)
	}
	if err := writeNewFile(filepath.Join(dir, "rsh"), []byte("evil"), 0o755); err == nil {
		t.Fatal("wrote through a link")
	}
	if b, _ := os.ReadFile(target); string(b) != "keep" {
		t.Fatalf("the link's target now holds %q", b)
	}
	if err := writeNewFile(filepath.Join(dir, "hostfile"), []byte("h"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "hostfile")); string(b) != "h" {
		t.Fatalf("hostfile holds %q", b)
	}
}

// TestCheckRunDirParentsLinkInUsersDir: a link to root's own directory that sits in a directory another user
// owns is that user's to point elsewhere once the check has passed (to their own directory, where they
// could swap the launcher script mpirun runs as root): refused, as is a link inside a link's target and
// another user's link in a sticky directory.
func TestCheckRunDirParentsLinkInUsersDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: the ownership checks are root's (and chown needs root); CI runs as root")
	}
	base := t.TempDir()
	mk := func(d string, uid int) string {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(d, uid, 0); err != nil {
			t.Fatal(err)
		}
		return d
	}
	good := mk(filepath.Join(base, "good"), 0)
	users := mk(filepath.Join(base, "users"), 65534)
	// users/toGood -> good: the resolved path is root's alone, the link is the user's.
	if err := os.Symlink(good, filepath.Join(users, "toGood")); err != nil {
		t.Fatal(err)
	}
	// rootlink -> users/toGood/sub: a root-owned link whose target goes through the user's link.
	mk(filepath.Join(good, "sub"), 0)
	if err := os.Symlink(filepath.Join(users, "toGood", "sub"), filepath.Join(base, "rootlink")); err != nil {
		t.Fatal(err)
	}
	// A relative link in root's directory that stays in root's directories is fine.
	if err := os.Symlink("good/sub", filepath.Join(base, "rel")); err != nil {
		t.Fatal(err)
	}
	// sticky/theirs -> good: a link another user made in a sticky directory (as /tmp) is theirs to replace.
	sticky := filepath.Join(base, "sticky")
	mk(sticky, 0)
	if err := os.Chmod(sticky, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(good, filepath.Join(sticky, "theirs")); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(filepath.Join(sticky, "theirs"), 65534, 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(good, filepath.Join(sticky, "roots")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ dir, err string }{
		{dir: filepath.Join(sticky, "theirs", "run"), err: "owned by uid 65534"},
		{dir: filepath.Join(sticky, "roots", "run")},
		{dir: filepath.Join(users, "toGood", "run"), err: "owned by uid 65534"},
		{dir: filepath.Join(users, "toGood", "not", "yet", "run"), err: "owned by uid 65534"},
		{dir: filepath.Join(base, "rootlink", "run"), err: "owned by uid 65534"},
		{dir: filepath.Join(base, "rel", "run")},
		{dir: filepath.Join(base, "rel", "..", "good", "run")},
	} {
		err := checkRunDirParents(tc.dir, 0)
		if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%s: %v, want %q", tc.dir, err, tc.err)
		}
	}
}

// TestMakeRunDirParentRace: root's check of the run directory's parents looks only up to the first missing
// one; another user who creates that one in a sticky directory (/tmp), as a directory or a link to theirs,
// before MkdirAll does, must not get root's run directory inside their directory.
func TestMakeRunDirParentRace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: the ownership checks are root's (and chown needs root); CI runs as root")
	}
	base := t.TempDir()
	sticky := filepath.Join(base, "sticky")
	if err := os.Mkdir(sticky, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(sticky, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	theirs := filepath.Join(base, "theirs")
	if err := os.Mkdir(theirs, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(theirs, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		plant func(p string) error // what the other user creates between the check and MkdirAll
	}{
		{"dir", func(p string) error {
			if err := os.Mkdir(p, 0o755); err != nil {
				return err
			}
			return os.Chown(p, 65534, 65534)
		}},
		{"link", func(p string) error {
			if err := os.Symlink(theirs, p); err != nil {
				return err
			}
			return os.Lchown(p, 65534, 65534)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			planted := filepath.Join(sticky, tc.name)
			dir := filepath.Join(planted, "runs", "run")
			mkdirAll := func(p string, perm os.FileMode) error {
				if err := tc.plant(planted); err != nil {
					t.Fatal(err)
				}
				return os.MkdirAll(p, perm)
			}
			err := makeRunDirParent(dir, 0, mkdirAll)
			if err == nil || !strings.Contains(err.Error(), "uid 65534") {
				t.Fatalf("run directory %s inside another user's directory: %v, want a refusal naming uid 65534", dir, err)
			}
		})
	}
	// Honest parents, missing or not, still pass.
	if err := makeRunDirParent(filepath.Join(sticky, "mine", "runs", "run"), 0, os.MkdirAll); err != nil {
		t.Fatal(err)
	}
	if err := makeRunDirParent(filepath.Join(sticky, "mine", "runs", "run2"), 0, os.MkdirAll); err != nil {
		t.Fatal(err)
	}
}
