package image

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mnt"
	sk_unix "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-unix"
	"google.golang.org/protobuf/proto"
)

// mntEntry is a mount of the job's namespace; ext marks it external (a host mount, CRIU's auto-detected key).
func mntEntry(id, parent uint32, point string, ext bool) *mnt.MntEntry {
	e := &mnt.MntEntry{Fstype: proto.Uint32(1), MntId: proto.Uint32(id), RootDev: proto.Uint32(1), ParentMntId: proto.Uint32(parent),
		Flags: proto.Uint32(0), Root: proto.String("/"), Mountpoint: proto.String(point), Source: proto.String("none"), Options: proto.String("")}
	if ext {
		e.ExtKey = proto.String("CRIU:AUTODETECTED")
	}
	return e
}

// marshalPartial marshals a message with only the fields the test needs (a unix socket's mount).
func marshalPartial(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{AllowPartial: true}.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func encodeMountsOf(t testing.TB, es ...*mnt.MntEntry) []byte {
	buf := appendHeader(nil, magicMounts)
	for _, e := range es {
		buf = appendEntry(buf, marshal(t, e))
	}
	return buf
}

func TestPruneGoneMounts(t *testing.T) {
	// The job's namespace: / (host), /proc (its own), /data (host) with /data/inner below it, /gone (host,
	// no longer on this host) with /gone/inner below it, and /used (host, gone, but a file is open on it).
	mounts := []*mnt.MntEntry{
		mntEntry(1, 1, "/", true),
		mntEntry(2, 1, "/proc", false),
		mntEntry(3, 1, "/data", true),
		mntEntry(4, 3, "/data/inner", true),
		mntEntry(5, 1, "/gone", true),
		mntEntry(6, 5, "/gone/inner", true),
		mntEntry(7, 1, "/used", true),
		mntEntry(8, 1, "/gone-own", false), // the job's own mount: CRIU makes its point itself
	}
	usedReg := regFileEntry(10, "/used/file", 1)
	usedReg.Reg.MntId = proto.Int32(7)
	hostReg := regFileEntry(11, "/data/file", 1) // mnt_id 3, which stays
	hostReg.Reg.MntId = proto.Int32(3)
	sock := &fdinfo.FileEntry{Type: fdinfo.FdTypes_UNIXSK.Enum(), Id: proto.Uint32(12), Usk: &sk_unix.UnixSkEntry{MntId: proto.Int32(1)}}
	root := t.TempDir()
	for _, d := range []string{"data/inner", "proc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name    string
		files   [][]byte
		want    []string
		wantIDs []uint32 // the mounts left
	}{
		{"gone and unused: dropped with what is below", [][]byte{marshal(t, hostReg), marshal(t, usedReg), pidfdEntryRaw()},
			[]string{"/gone", "/gone/inner"}, []uint32{1, 2, 3, 4, 7, 8}},
		{"a file on a mount below: kept", [][]byte{marshal(t, usedReg), marshal(t, func() *fdinfo.FileEntry {
			e := regFileEntry(13, "/gone/inner/f", 1)
			e.Reg.MntId = proto.Int32(6)
			return e
		}())}, nil, []uint32{1, 2, 3, 4, 5, 6, 7, 8}},
		{"a unix socket bound on it: kept, the unused mount below it dropped", [][]byte{marshal(t, usedReg), marshalPartial(t, &fdinfo.FileEntry{Type: fdinfo.FdTypes_UNIXSK.Enum(),
			Id: proto.Uint32(14), Usk: &sk_unix.UnixSkEntry{MntId: proto.Int32(5)}})}, []string{"/gone/inner"}, []uint32{1, 2, 3, 4, 5, 7, 8}},
		{"no file names a mount: every gone one dropped", [][]byte{marshalPartial(t, sock)}, []string{"/gone", "/gone/inner", "/used"}, []uint32{1, 2, 3, 4, 8}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			orig := encodeMountsOf(t, mounts...)
			writeImage(t, dir, "mountpoints-13.img", orig)
			writeImage(t, dir, filesName, encodeFilesRaw(tt.files...))
			got, err := PruneGoneMounts(dir, root)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("dropped %q, want %q", got, tt.want)
			}
			b, err := os.ReadFile(filepath.Join(dir, "mountpoints-13.img"))
			if err != nil {
				t.Fatal(err)
			}
			m, err := decodeMounts("mountpoints-13.img", b)
			if err != nil {
				t.Fatal(err)
			}
			var ids []uint32
			for _, e := range m.entries {
				ids = append(ids, e.GetMntId())
			}
			if !slices.Equal(ids, tt.wantIDs) {
				t.Errorf("mounts left %v, want %v", ids, tt.wantIDs)
			}
			if len(tt.want) == 0 && !bytes.Equal(b, orig) {
				t.Error("the image was rewritten with nothing to drop")
			}
		})
	}
}

func TestPruneGoneMountsWithoutMountImages(t *testing.T) {
	// A job in its host's namespace (an older agent's) has no mount image and no files.img is needed.
	got, err := PruneGoneMounts(t.TempDir(), "/")
	if err != nil || got != nil {
		t.Fatalf("PruneGoneMounts of images without a mount namespace: %q %v", got, err)
	}
}

func TestPruneGoneMountsParentCycle(t *testing.T) {
	// A corrupt image whose parents form a cycle: the walk up ends, nothing hangs.
	m := &mountsImage{entries: []*mnt.MntEntry{mntEntry(1, 2, "/a", true), mntEntry(2, 1, "/b", true)}}
	drop, err := m.gone("/", func() (map[uint32]bool, error) { return nil, nil }, func(string) (bool, error) { return false, nil })
	if err != nil || !slices.Equal(drop, []int{0, 1}) {
		t.Fatalf("gone: %v %v", drop, err)
	}
}

// FuzzDecodeMounts: the mount image decoder never panics, and what it accepts re-encodes byte for byte;
// the pruning walk over any accepted image ends.
func FuzzDecodeMounts(f *testing.F) {
	f.Add(encodeMountsOf(f, mntEntry(1, 1, "/", true), mntEntry(2, 1, "/x", true)))
	f.Add(appendHeader(nil, magicMounts))
	f.Add(encodeMountsOf(f, mntEntry(1, 2, "/a", true), mntEntry(2, 1, "/b", true)))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMounts("mountpoints-1.img", b)
		if err != nil {
			return
		}
		if !bytes.Equal(m.encode(), b) {
			t.Fatal("re-encode differs")
		}
		if _, err := m.gone("/nonexistent-root", func() (map[uint32]bool, error) { return map[uint32]bool{1: true}, nil }, func(string) (bool, error) { return false, nil }); err != nil {
			t.Fatal(err)
		}
		// Some mount points there and some not, some mounts in use: as the walk from every mount up to every
		// missing one decides.
		inUse := map[uint32]bool{}
		for i, e := range m.entries {
			if i%3 == 1 {
				inUse[e.GetMntId()] = true
			}
		}
		used := func() (map[uint32]bool, error) { return inUse, nil }
		exists := func(p string) (bool, error) { return len(p)%2 == 0, nil }
		got, err := m.gone("/", used, exists)
		if err != nil {
			t.Fatal(err)
		}
		if want := goneByWalks(m, "/", inUse, exists); !slices.Equal(got, want) {
			t.Fatalf("gone = %v, want %v", got, want)
		}
	})
}

// goneByWalks is what gone returns, found by walking up from every mount to every missing external one.
func goneByWalks(m *mountsImage, root string, inUse map[uint32]bool, exists func(string) (bool, error)) []int {
	byID := map[uint32]int{}
	for i, e := range m.entries {
		byID[e.GetMntId()] = i
	}
	under := func(i, c int) bool {
		for range len(m.entries) {
			if i == c {
				return true
			}
			p, ok := byID[m.entries[i].GetParentMntId()]
			if !ok || p == i {
				return false
			}
			i = p
		}
		return false
	}
	var drop []int
	for c, e := range m.entries {
		if ok, _ := exists(filepath.Join(root, e.GetMountpoint())); ok || e.GetExtKey() == "" && !e.GetExtMount() {
			continue
		}
		var subtree []int
		busy := false
		for i := range m.entries {
			if under(i, c) {
				subtree = append(subtree, i)
				busy = busy || inUse[m.entries[i].GetMntId()]
			}
		}
		if !busy {
			drop = append(drop, subtree...)
		}
	}
	slices.Sort(drop)
	return slices.Compact(drop)
}

// TestPruneGoneMountsIsNotCubic: a mount image comes from another node; one of a few thousand external
// mounts, each below the one before and none of them on this host, is pruned at once. The walk up from
// every mount to every missing one took time cubic in the mounts: 4096 of them (some 250 KB of image)
// held the root agent's restore for minutes.
func TestPruneGoneMountsIsNotCubic(t *testing.T) {
	const n = 4096
	m := &mountsImage{}
	for i := range n {
		m.entries = append(m.entries, mntEntry(uint32(i+1), uint32(max(i, 1)), fmt.Sprintf("/m%d", i), true))
	}
	done := make(chan []int, 1)
	go func() {
		drop, err := m.gone("/", func() (map[uint32]bool, error) { return nil, nil }, func(string) (bool, error) { return false, nil })
		if err != nil {
			t.Error(err)
		}
		done <- drop
	}()
	select {
	case drop := <-done:
		if len(drop) != n {
			t.Fatalf("dropped %d mounts, want all %d", len(drop), n)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("pruning %d nested missing mounts took more than 10 s", n)
	}
}

// TestPruneGoneMountsDirWithPatternChars: the images directory is a path, not a pattern: under a state
// directory named with "[", the job's own mount image is pruned and a sibling directory's, which the
// pattern would match, is left alone.
func TestPruneGoneMountsDirWithPatternChars(t *testing.T) {
	base, root := t.TempDir(), t.TempDir()
	mounts := encodeMountsOf(t, mntEntry(1, 1, "/", true), mntEntry(2, 1, "/gone", true))
	dir, sibling := filepath.Join(base, "snap[1]"), filepath.Join(base, "snap1")
	for _, d := range []string{dir, sibling} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		writeImage(t, d, "mountpoints-13.img", mounts)
		writeImage(t, d, filesName, encodeFilesRaw())
	}
	got, err := PruneGoneMounts(dir, root)
	if err != nil || !slices.Equal(got, []string{"/gone"}) {
		t.Fatalf("PruneGoneMounts(%s) = %q, %v; want [/gone]", dir, got, err)
	}
	if b, err := os.ReadFile(filepath.Join(sibling, "mountpoints-13.img")); err != nil || !bytes.Equal(b, mounts) {
		t.Fatalf("the sibling directory's image was rewritten (%v)", err)
	}
}
