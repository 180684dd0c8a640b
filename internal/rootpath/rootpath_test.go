package rootpath

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestResolve: the directories a path passes through include a link's directory and its target's, as the
// kernel follows them, and ".." after a link is the target's parent.
func TestResolve(t *testing.T) {
	b := t.TempDir()
	for _, d := range []string{"a/real", "c"} {
		if err := os.MkdirAll(filepath.Join(b, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(filepath.Join(b, "a", "real"), filepath.Join(b, "c", "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(b, "a", "f"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	real, dirs, err := Resolve(b + "/c/link/../f") // not joined: Join would clean ".." away
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(b, "a", "f"); real != want {
		t.Errorf("Resolve = %s, want %s", real, want)
	}
	for _, d := range []string{filepath.Join(b, "c"), filepath.Join(b, "a"), filepath.Join(b, "a", "real")} {
		if !slices.Contains(dirs, d) {
			t.Errorf("directories on the way %v lack %s", dirs, d)
		}
	}
}

func TestExistingPart(t *testing.T) {
	b := t.TempDir()
	os.Symlink(filepath.Join(b, "nowhere"), filepath.Join(b, "dangling"))
	tests := []struct{ path, want string }{
		{b, b},
		{filepath.Join(b, "x", "y"), b},
		{filepath.Join(b, "dangling", "y"), filepath.Join(b, "dangling")},
		{"/nonexistent-ftkit/x", "/"},
	}
	for _, tc := range tests {
		if got := ExistingPart(tc.path); got != tc.want {
			t.Errorf("ExistingPart(%s) = %s, want %s", tc.path, got, tc.want)
		}
	}
}

// TestOnTheWay: a directory another user owns or others may write is refused on the way, but a sticky one
// of root's (like /tmp).
func TestOnTheWay(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root to chown a directory to another user")
	}
	b := t.TempDir()
	mk := func(name string, mode os.FileMode, uid int) string {
		p := filepath.Join(b, name)
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, uid, uid); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tests := []struct {
		dir  string
		want string // "" means accepted
	}{
		{mk("private", 0o755, 0), ""},
		{mk("tmp", 0o777|os.ModeSticky, 0), ""},
		{mk("open", 0o777, 0), "mode 0777"},
		{mk("users", 0o755, 65534), "uid 65534"},
		{mk("userstmp", 0o777|os.ModeSticky, 65534), "uid 65534"},
	}
	for _, tc := range tests {
		err := OnTheWay([]string{tc.dir}, "test")
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("OnTheWay(%s) = %v, want %q", tc.dir, err, tc.want)
		}
	}
}

// TestSafeDirUsersLinkInStickyDir: a sticky directory keeps others from replacing root's entries, not
// their own: another user's link there, though it leads to root's directory, is theirs to point elsewhere.
func TestSafeDirUsersLinkInStickyDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root to chown a link to another user")
	}
	b := t.TempDir()
	tmp, real := filepath.Join(b, "tmp"), filepath.Join(b, "real")
	for _, d := range []string{tmp, real} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(tmp, 0o777|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	for name, uid := range map[string]int{"rootlink": 0, "userlink": 65534} {
		l := filepath.Join(tmp, name)
		if err := os.Symlink(real, l); err != nil {
			t.Fatal(err)
		}
		if err := os.Lchown(l, uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		dir  string
		want string // "" means accepted
	}{
		{filepath.Join(tmp, "rootlink", "state"), ""},
		{filepath.Join(tmp, "userlink", "state"), "uid 65534"},
		{filepath.Join(tmp, "userlink"), "is not a directory"}, // a link as dir itself, as before
	}
	for _, tc := range tests {
		err := SafeDir(tc.dir, false)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("SafeDir(%s) = %v, want %q", tc.dir, err, tc.want)
		}
	}
}
