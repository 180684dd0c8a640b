package criu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/ftkit/ftkit/internal/testenv"
)

func TestYardLinks(t *testing.T) {
	hybrid := []*mountinfo.Info{
		{Root: "/", Mountpoint: "/sys/fs/cgroup/cpu,cpuacct", FSType: "cgroup", VFSOptions: "rw,cpu,cpuacct"},
		{Root: "/", Mountpoint: "/sys/fs/cgroup/memory", FSType: "cgroup", VFSOptions: "rw,memory"},
		{Root: "/", Mountpoint: "/sys/fs/cgroup/systemd", FSType: "cgroup", VFSOptions: "rw,xattr,name=systemd"},
		{Root: "/", Mountpoint: "/sys/fs/cgroup/unified", FSType: "cgroup2", VFSOptions: "rw,nsdelegate"},
	}
	cases := []struct {
		name    string
		cgroup  string
		mounts  []*mountinfo.Info
		want    map[string]string
		wantErr string
	}{
		{
			name:   "cgroup v2 only",
			cgroup: "0::/system.slice/ftagent.service\n",
			mounts: []*mountinfo.Info{{Root: "/", Mountpoint: "/sys/fs/cgroup", FSType: "cgroup2", VFSOptions: "rw,nsdelegate,memory_recursiveprot"}},
			want:   map[string]string{"unified": "/sys/fs/cgroup"},
		},
		{
			name:   "hybrid, co-mounted and named hierarchies",
			cgroup: "4:name=systemd:/system.slice/ftagent.service\n3:memory:/system.slice\n2:cpu,cpuacct:/\n0::/system.slice/ftagent.service\n",
			mounts: hybrid,
			want: map[string]string{"systemd": "/sys/fs/cgroup/systemd", "memory": "/sys/fs/cgroup/memory",
				"cpu,cpuacct": "/sys/fs/cgroup/cpu,cpuacct", "unified": "/sys/fs/cgroup/unified"},
		},
		{
			name:   "a mount of a sub-tree is not the hierarchy's root",
			cgroup: "0::/\n",
			mounts: []*mountinfo.Info{
				{Root: "/lxc/c1", Mountpoint: "/mnt/c1", FSType: "cgroup2"},
				{Root: "/", Mountpoint: "/sys/fs/cgroup", FSType: "cgroup2"},
			},
			want: map[string]string{"unified": "/sys/fs/cgroup"},
		},
		{
			name:    "a hierarchy mounted only below its root",
			cgroup:  "0::/\n",
			mounts:  []*mountinfo.Info{{Root: "/lxc/c1", Mountpoint: "/sys/fs/cgroup", FSType: "cgroup2"}},
			wantErr: `hierarchy ""`,
		},
		{
			name:    "a v1 hierarchy not mounted",
			cgroup:  "5:pids:/\n0::/\n",
			mounts:  hybrid,
			wantErr: `hierarchy "pids"`,
		},
		{
			name:    "one controller of a co-mounted pair is not the pair",
			cgroup:  "2:cpu,cpuacct:/\n",
			mounts:  []*mountinfo.Info{{Root: "/", Mountpoint: "/sys/fs/cgroup/cpu", FSType: "cgroup", VFSOptions: "rw,cpu"}},
			wantErr: `hierarchy "cpu,cpuacct"`,
		},
		{
			name:    "malformed line",
			cgroup:  "0:/\n",
			mounts:  hybrid,
			wantErr: "malformed",
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctls, err := hierarchies([]byte(c.cgroup))
			var got map[string]string
			if err == nil {
				got, err = yardLinks(ctls, c.mounts)
			}
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("got %v, %v; want an error containing %q", got, err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !maps.Equal(got, c.want) {
				t.Fatalf("got %v, want %v", got, c.want)
			}
		})
	}
}

// TestDumpWithCgroupYard: a dump given a yard by NewCgroupYard writes the cgroup image a dump without
// one writes, and it is the yard CRIU reads (a yard with two v1 entries swapped changes the dump); a yard
// that does not lead to the root of every hierarchy of the host (an entry missing, or leading to a plain
// directory or to a cgroup below a root) is made again before the dump, which writes the same image.
// (Until 2026-11-30 such a yard went unused, and unrepaired, for the rest of the agent's life.)
func TestDumpWithCgroupYard(t *testing.T) {
	bin := requireCRIU(t, "CRIU, a network namespace and the host's cgroup mounts")
	child, ns, _ := startSender(t)
	y, err := NewCgroupYard(filepath.Join(t.TempDir(), "yard"), nil)
	if err != nil {
		t.Fatal(err)
	}
	yard := y.dir
	if fi, err := os.Stat(yard); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("yard %s: %v, %v; want a directory of mode 0700", yard, fi, err)
	}
	// The child in a cgroup of its own, as a job is: CRIU writes no cgroup image for a task in CRIU's cgroups.
	cg := filepath.Join(yard, "unified", fmt.Sprintf("ftkit-criu-test-%d", child.Process.Pid))
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = child.Process.Kill()
		_, _ = child.Process.Wait()
		if err := os.Remove(cg); err != nil {
			t.Errorf("remove the test's cgroup: %v", err)
		}
	})
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(child.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	dump := func(yard *CgroupYard) ([]byte, error) {
		dir := t.TempDir()
		if _, err := (Client{Binary: bin, CgroupYard: yard}).Dump(ctx, DumpOptions{PID: child.Process.Pid, ImagesDir: dir, LeaveRunning: true, Netns: ns}); err != nil {
			return nil, err
		}
		return os.ReadFile(filepath.Join(dir, "cgroup.img"))
	}
	ref, err := dump(nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := dump(y)
	if err != nil {
		t.Fatalf("dump with the yard: %v", err)
	}
	if !bytes.Equal(got, ref) {
		t.Fatalf("the cgroup image of a dump with the yard (%d bytes) differs from one without (%d bytes)", len(got), len(ref))
	}

	if err := cgroupYardUsable(yard); err != nil {
		t.Fatalf("the yard made by NewCgroupYard is not usable: %v", err)
	}

	// Yards that do not lead to every hierarchy's root are made again: the dump is as with a good one.
	for _, c := range []struct {
		name   string
		target string // where "unified" leads; "" removes it
	}{
		{"entry missing", ""},
		{"entry leading to a plain directory", t.TempDir()},
		{"entry leading to a cgroup below the root", cg},
	} {
		bad := copyYard(t, yard)
		if err := os.Remove(filepath.Join(bad, "unified")); err != nil {
			t.Fatal(err)
		}
		if c.target != "" {
			if err := os.Symlink(c.target, filepath.Join(bad, "unified")); err != nil {
				t.Fatal(err)
			}
		}
		if cgroupYardUsable(bad) == nil {
			t.Errorf("%s: the yard is taken as usable", c.name)
		}
		logs := &testenv.SyncBuffer{}
		if got, err := dump(&CgroupYard{dir: bad, log: slog.New(slog.NewTextHandler(logs, nil))}); err != nil || !bytes.Equal(got, ref) {
			t.Errorf("%s: %v (image equal: %v); want it dumped as with a good yard", c.name, err, bytes.Equal(got, ref))
		}
		if err := cgroupYardUsable(bad); err != nil {
			t.Errorf("%s: the yard was not made again: %v", c.name, err)
		}
		if !strings.Contains(logs.String(), "cgroup yard made again") {
			t.Errorf("%s: the log does not say the yard was made again: %q", c.name, logs.String())
		}
	}

	// The cpuset hierarchy swapped with another v1 one: each entry still leads to a hierarchy's root, and
	// CRIU, reading cpuset's properties (cpuset.cpus, cpuset.mems: every cpuset cgroup has them) where the
	// other's are, writes another image or fails.
	ctls, err := ownHierarchies()
	if err != nil {
		t.Fatal(err)
	}
	var other string
	for _, ctl := range ctls {
		if ctl != "" && !strings.Contains(ctl, "cpuset") && !strings.HasPrefix(ctl, "name=") {
			other = yardName(ctl)
		}
	}
	if !slices.Contains(ctls, "cpuset") || other == "" {
		t.Logf("this host has no cgroup v1 cpuset hierarchy beside another v1 one (%q): the check that CRIU reads the yard, which swaps them, is left out", ctls)
		return
	}
	swapped := copyYard(t, yard)
	for _, p := range [][2]string{{"cpuset", other}, {other, "cpuset"}} {
		target, err := os.Readlink(filepath.Join(yard, p[1]))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(filepath.Join(swapped, p[0])); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, filepath.Join(swapped, p[0])); err != nil {
			t.Fatal(err)
		}
	}
	if err := cgroupYardUsable(swapped); err != nil {
		t.Fatalf("a yard with two v1 entries swapped is not usable (%v): the check cannot tell", err)
	}
	if got, err := dump(&CgroupYard{dir: swapped, log: slog.New(slog.DiscardHandler)}); err == nil && bytes.Equal(got, ref) {
		t.Fatalf("a dump whose yard has cpuset and %s swapped wrote the same cgroup image: CRIU did not read the yard", other)
	}
}

// TestCgroupYardRemadeOnlyWhenUnused: a dump that finds the yard stale makes it again only once the
// dumps using it have ended, and then dumps with it. Until 2026-12-01 it removed and remade the directory at
// once, under the CRIU of a dump that was using it.
func TestCgroupYardRemadeOnlyWhenUnused(t *testing.T) {
	testenv.RequireKernel(t, "the host's cgroup mounts, read as root")
	y, err := NewCgroupYard(filepath.Join(t.TempDir(), "yard"), nil)
	if err != nil {
		t.Fatal(err)
	}
	dir, release := y.forDump()
	if dir == "" {
		t.Fatal("a yard just made is not used")
	}
	// The host's hierarchies change while the first dump runs: the yard no longer leads to cgroup v2.
	entry := filepath.Join(dir, "unified")
	if err := os.Remove(entry); err != nil {
		t.Fatal(err)
	}
	waiting := make(chan struct{})
	y.waitingForDumps = sync.OnceFunc(func() { close(waiting) })
	second := make(chan string, 1)
	go func() {
		d, rel := y.forDump()
		rel()
		second <- d
	}()
	select {
	case <-waiting:
	case d := <-second:
		t.Fatalf("a second dump made the yard again (%q) while the first one used it", d)
	}
	// The second dump waits for the first to release the yard: it is as the first dump's CRIU found it.
	if _, err := os.Lstat(entry); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the yard was made again while a dump used it (%v)", err)
	}
	release()
	if d := <-second; d != dir {
		t.Fatalf("the second dump got yard %q, want %q made again", d, dir)
	}
	if err := cgroupYardUsable(dir); err != nil {
		t.Fatalf("the yard was not made again: %v", err)
	}
	y.waitingForDumps = func() { t.Error("a dump waited for others to make a usable yard again") }
	if d, rel := y.forDump(); d != dir {
		t.Errorf("a third dump got yard %q, want %q", d, dir)
	} else {
		rel()
	}
}

// copyYard copies the links of yard into a new directory.
func copyYard(t *testing.T, yard string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "yard")
	if err := os.CopyFS(dir, os.DirFS(yard)); err != nil {
		t.Fatal(err)
	}
	return dir
}
