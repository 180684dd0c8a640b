//go:build linux

package capture

import (
	"log/slog"
	"maps"
	"slices"
	"testing"
)

// fakeCgroupProbe is the probe's map of protected cgroups.
type fakeCgroupProbe map[uint64]bool

func (f fakeCgroupProbe) Protect(id uint64) error   { f[id] = true; return nil }
func (f fakeCgroupProbe) Unprotect(id uint64) error { delete(f, id); return nil }

// TestProtectRecreatedCgroup: a job's cgroup directory removed and made again (a restored job) has a new
// id; protecting the directory again must not leave the old id in the probe's map, where it took one of its
// 1024 entries for good and went on logging the old cgroup's sockets, which Protects disowned.
func TestProtectRecreatedCgroup(t *testing.T) {
	c := &Capture{log: slog.New(slog.NewTextHandler(t.Output(), nil)), protected: map[string]uint64{}}
	p := fakeCgroupProbe{}
	const dir = "/sys/fs/cgroup/ftkit/job-1"
	for _, id := range []uint64{11, 12} {
		c.mu.Lock()
		err := c.protectID(p, dir, id)
		c.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := slices.Sorted(maps.Keys(p)); !slices.Equal(got, []uint64{12}) || c.Protects(11) || !c.Protects(12) {
		t.Fatalf("the probe protects %v, Protects(11) %v, Protects(12) %v: want only the directory's new id 12", got, c.Protects(11), c.Protects(12))
	}
}
