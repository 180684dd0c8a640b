package stalemounts

import (
	"os"
	"slices"
	"testing"

	"github.com/moby/sys/mountinfo"
)

func mnt(id, parent, minor int, point string) *mountinfo.Info {
	return &mountinfo.Info{ID: id, Parent: parent, Major: 0, Minor: minor, Mountpoint: point}
}

func TestGone(t *testing.T) {
	root := mnt(1, 0, 1, "/")
	shm := mnt(2, 1, 2, "/dev/shm")
	proc := mnt(3, 1, 3, "/proc") // the job's own: never on the host
	store := mnt(4, 1, 4, "/var/lib/store")
	inner := mnt(5, 4, 5, "/var/lib/store/inner")
	bind := mnt(6, 4, 1, "/var/lib/store/bind") // a bind of the root file system, below the store
	hostAll := []*mountinfo.Info{mnt(101, 0, 1, "/"), mnt(102, 101, 2, "/dev/shm"), mnt(104, 101, 4, "/var/lib/store"), mnt(105, 104, 5, "/var/lib/store/inner")}
	hostNoStore := hostAll[:2]
	for _, tt := range []struct {
		name     string
		job      []*mountinfo.Info
		host     []*mountinfo.Info
		seen     copies
		want     []string
		wantNext copies
	}{
		{
			name: "first look: nothing seen, nothing skipped",
			job:  []*mountinfo.Info{root, shm, proc, store, inner}, host: hostNoStore,
			wantNext: copies{1: {0, 1}, 2: {0, 2}},
		},
		{
			name: "copies recorded while the host has them",
			job:  []*mountinfo.Info{root, shm, proc, store, inner}, host: hostAll,
			wantNext: copies{1: {0, 1}, 2: {0, 2}, 4: {0, 4}, 5: {0, 5}},
		},
		{
			name: "the host unmounted a copy: it goes, with everything below it",
			job:  []*mountinfo.Info{root, shm, proc, store, inner, bind}, host: hostNoStore,
			seen: copies{1: {0, 1}, 2: {0, 2}, 4: {0, 4}, 5: {0, 5}},
			want: []string{"/var/lib/store", "/var/lib/store/bind", "/var/lib/store/inner"},
			// bind's file system is on the host: remembered, though skipped with its parent
			wantNext: copies{1: {0, 1}, 2: {0, 2}, 4: {0, 4}, 5: {0, 5}, 6: {0, 1}},
		},
		{
			name: "a mount the job made is never skipped",
			job:  []*mountinfo.Info{root, proc, mnt(7, 1, 7, "/mnt/mine")}, host: hostNoStore,
			seen:     copies{1: {0, 1}},
			wantNext: copies{1: {0, 1}},
		},
		{
			name: "a mount ID reused with another file system is not the copy seen",
			job:  []*mountinfo.Info{root, mnt(4, 1, 9, "/var/lib/store")}, host: hostNoStore,
			seen:     copies{1: {0, 1}, 4: {0, 4}},
			wantNext: copies{1: {0, 1}},
		},
		{
			name: "a stale copy stacked on a mount that stays at the same path is left to CRIU",
			job:  []*mountinfo.Info{root, store, mnt(8, 4, 8, "/var/lib/store")}, host: hostAll,
			seen:     copies{1: {0, 1}, 4: {0, 4}, 8: {0, 8}},
			wantNext: copies{1: {0, 1}, 4: {0, 4}, 8: {0, 8}},
		},
		{
			name: "a parent cycle ends the walk",
			job:  []*mountinfo.Info{mnt(1, 2, 1, "/"), mnt(2, 1, 2, "/x")}, host: hostNoStore,
			seen:     copies{1: {0, 1}},
			wantNext: copies{1: {0, 1}, 2: {0, 2}},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got, next := gone(tt.job, tt.host, tt.seen)
			if !slices.Equal(got, tt.want) {
				t.Errorf("skip %q, want %q", got, tt.want)
			}
			if len(next) != len(tt.wantNext) {
				t.Errorf("remembered %v, want %v", next, tt.wantNext)
			}
			for id, d := range tt.wantNext {
				if next[id] != d {
					t.Errorf("remembered %v, want %v", next, tt.wantNext)
					break
				}
			}
		})
	}
}

// TestTrackerOwnNamespace runs Gone on this process: the host's namespace is its own, so nothing is stale.
func TestTrackerOwnNamespace(t *testing.T) {
	var tr Tracker
	for range 2 {
		skip, err := tr.Gone("self", os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		if len(skip) != 0 {
			t.Fatalf("skip %q in the host's own namespace", skip)
		}
	}
	if len(tr.jobs["self"].copies) == 0 {
		t.Fatal("no mount of this process recorded as the host's")
	}
	if _, err := tr.Gone("ended", 1<<22+1); err == nil { // above pid_max's limit: no such process
		t.Fatal("Gone of a process that does not exist: no error")
	}
}
