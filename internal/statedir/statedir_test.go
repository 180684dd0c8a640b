package statedir

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func perm(t *testing.T, p string) fs.FileMode {
	t.Helper()
	st, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

func writeOld(t *testing.T, p string, mode fs.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("{}"), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
}

// TestPrepare checks the modes of an agent's directories and files under the systemd unit's umask (its
// state directory and job records private; its jobs_dir and socket directory public), for an older
// version's state directory, in both layouts: jobs_dir inside state_dir (the default) and beside it (the
// lab's).
func TestPrepare(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (chown of a user's job directory)")
	}
	tests := []struct {
		name             string
		state, jobs      string // relative to a temp dir
		wantState        fs.FileMode
		recordsArePublic bool
		fresh            bool // nothing exists yet
	}{
		{"default layout", "var/lib/ftkit", "var/lib/ftkit/jobs", 0o711, true, false},
		{"jobs_dir apart", "state/n1", "shared/jobs", 0o700, false, false},
		// The lab's: every host's state_dir beside the cluster's jobs_dir, under a parent no one made yet.
		{"fresh, shared parent", "lab/n1", "lab/jobs", 0o700, false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Set up as an administrator would (umask 022), then start under the unit's umask.
			old := unix.Umask(0o022)
			defer unix.Umask(old)
			base := t.TempDir()
			stateDir := filepath.Join(base, tc.state)
			jobsDir := filepath.Join(base, tc.jobs)
			socketDir := filepath.Join(base, "run/ftkit")
			records := filepath.Join(stateDir, "jobs")
			prepare := func() error { return Prepare([]string{stateDir, records}, []string{jobsDir, socketDir}) }

			want := map[string]fs.FileMode{
				stateDir:                         tc.wantState,
				jobsDir:                          0o755,
				filepath.Join(base, "run"):       0o755,
				filepath.Join(base, "run/ftkit"): 0o755,
			}
			if !tc.recordsArePublic {
				want[records] = 0o700
				want[filepath.Dir(jobsDir)] = 0o755
			}
			if !tc.fresh {
				// What an older version left: everything world-readable.
				if err := os.MkdirAll(stateDir, 0o755); err != nil {
					t.Fatal(err)
				}
				os.Chmod(stateDir, 0o755)
				for _, f := range []string{"view.json", "failures.json", "claim.json"} {
					writeOld(t, filepath.Join(stateDir, f), 0o644)
					want[filepath.Join(stateDir, f)] = 0o600
				}
				writeOld(t, filepath.Join(records, "lu-1.json"), 0o644)
				writeOld(t, filepath.Join(records, "lu-1.shim.log"), 0o644)
				writeOld(t, filepath.Join(stateDir, "restore", "x", "pages-1.img"), 0o644)
				for _, d := range []string{"restore", "restore/x", "jobs"} {
					os.Chmod(filepath.Join(stateDir, d), 0o755)
				}
				want[filepath.Join(stateDir, "restore")] = 0o700
				want[filepath.Join(records, "lu-1.json")] = 0o600
				want[filepath.Join(records, "lu-1.shim.log")] = 0o600
				// A user's job directory in jobs_dir, and a link a user might plant there.
				userDir := filepath.Join(jobsDir, "lu-1")
				if err := os.MkdirAll(userDir, 0o755); err != nil {
					t.Fatal(err)
				}
				os.Chmod(userDir, 0o755)
				if err := os.Chown(userDir, 1000, 1000); err != nil {
					t.Fatal(err)
				}
				want[userDir] = 0o755
				outside := filepath.Join(base, "outside")
				writeOld(t, outside, 0o644)
				if err := os.Symlink(outside, filepath.Join(jobsDir, "evil.json")); err != nil {
					t.Fatal(err)
				}
				want[outside] = 0o644
			}

			unix.Umask(0o077) // which would make new directories 0700
			if err := prepare(); err != nil {
				t.Fatal(err)
			}
			for p, m := range want {
				if got := perm(t, p); got != m {
					t.Errorf("%s: mode %v, want %v", strings.TrimPrefix(p, base), got, m)
				}
			}
			// Idempotent: a second start changes nothing and fails on nothing.
			if err := prepare(); err != nil {
				t.Fatal(err)
			}
			if got := perm(t, stateDir); got != tc.wantState {
				t.Errorf("state dir mode %v after a second start", got)
			}
		})
	}
}

// TestPrepareLeavesHardLinkAlone plants, in a world-writable jobs_dir (which is also the records directory,
// the default layout), a hard link to a root-owned file elsewhere: O_NOFOLLOW stops a symbolic link, not a
// hard one, and the file is root's, so only its link count tells it from a record root wrote there.
func TestPrepareLeavesHardLinkAlone(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root")
	}
	base := t.TempDir()
	stateDir := filepath.Join(base, "var/lib/ftkit")
	records := filepath.Join(stateDir, "jobs")
	if err := os.MkdirAll(records, 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chmod(records, 0o1777) // "a jobs_dir made world-writable"
	outside := filepath.Join(base, "etc-passwd")
	writeOld(t, outside, 0o644)
	// What the user does with ln(1); root does it here for the test.
	if err := os.Link(outside, filepath.Join(records, "evil.json")); err != nil {
		t.Fatal(err)
	}
	if err := Prepare([]string{stateDir, records}, []string{records, filepath.Join(base, "run/ftkit")}); err != nil {
		t.Fatal(err)
	}
	if got := perm(t, outside); got != 0o644 {
		t.Errorf("root's file outside the state directory: mode %v after Prepare, want 0644 (chmod through a planted hard link)", got)
	}
}

// TestPrepareRefusesDirRootDidNotMake: a private directory that already exists as a link, or as another
// user's directory, is refused and left as it is. Before, root chmod-ed what the link pointed to (state_dir
// /tmp/ftkit, a link a user made to /etc: /etc 0711, every file of root's in it 0600, every directory 0700)
// and kept its memory images and records in a directory its owner could read and change.
func TestPrepareRefusesDirRootDidNotMake(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: needs root (chown to a user)")
	}
	tests := []struct {
		name  string
		setup func(t *testing.T, base, state string) (victims map[string]fs.FileMode)
		want  string
	}{
		{"state_dir a link to root's directory", func(t *testing.T, base, state string) map[string]fs.FileMode {
			etc := filepath.Join(base, "etc")
			writeOld(t, filepath.Join(etc, "passwd"), 0o644)
			if err := os.Mkdir(filepath.Join(etc, "ssh"), 0o755); err != nil {
				t.Fatal(err)
			}
			os.Chmod(etc, 0o755)
			if err := os.Symlink(etc, state); err != nil {
				t.Fatal(err)
			}
			return map[string]fs.FileMode{etc: 0o755, filepath.Join(etc, "passwd"): 0o644, filepath.Join(etc, "ssh"): 0o755}
		}, "link"},
		{"state_dir a user's directory", func(t *testing.T, base, state string) map[string]fs.FileMode {
			if err := os.Mkdir(state, 0o755); err != nil {
				t.Fatal(err)
			}
			os.Chmod(state, 0o755)
			if err := os.Chown(state, 1000, 1000); err != nil {
				t.Fatal(err)
			}
			return map[string]fs.FileMode{state: 0o755}
		}, "uid 1000"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			state := filepath.Join(base, "state")
			victims := tc.setup(t, base, state)
			err := Prepare([]string{state, filepath.Join(state, "jobs")}, []string{filepath.Join(base, "jobs"), filepath.Join(base, "run")})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Prepare = %v, want an error saying %q", err, tc.want)
			}
			for p, m := range victims {
				if got := perm(t, p); got != m {
					t.Errorf("%s: mode %v after Prepare, want %v untouched", strings.TrimPrefix(p, base), got, m)
				}
			}
		})
	}
}
