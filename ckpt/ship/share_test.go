package ship

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/testenv"
)

// xfsMount mounts a new XFS file system of size bytes (reflink on, as mkfs.xfs makes it by default since
// xfsprogs 5.1) from an image in a temporary directory, and unmounts it when t ends.
func xfsMount(t *testing.T, size int64) string {
	t.Helper()
	testenv.RequireKernel(t, "a loop-mounted XFS file system")
	img := filepath.Join(t.TempDir(), "xfs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.xfs", "-q", "-m", "reflink=1", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs (xfsprogs, installed by scripts/setup.sh): %v: %s", err, out)
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-o", "loop", img, dir).CombinedOutput(); err != nil {
		t.Fatalf("mount the XFS image: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", dir, err, out)
		}
	})
	return dir
}

// usedBytes is how much of the file system at dir is allocated.
func usedBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Blocks-st.Bfree) * st.Bsize
}

// On a protector whose store can share blocks (XFS), a snapshot rebuilt from a diff shares the blocks it
// takes from its base instead of writing them: 10% of a 32 MiB pages file rewritten costs about a tenth of
// it on the disk, and the replica verifies and is byte for byte the sender's. Without ShareBlocks every
// byte is written, as on a file system that cannot share (ext4: every other test of this package).
func TestReceiveSharesBaseBlocks(t *testing.T) {
	for _, share := range []bool{true, false} {
		t.Run(map[bool]string{true: "shared", false: "written"}[share], func(t *testing.T) {
			origin := openStore(t, "node1")
			prot, err := ckpt.Open(filepath.Join(xfsMount(t, 512<<20), "store"), ckpt.Options{Node: "prot"})
			if err != nil {
				t.Fatal(err)
			}
			p1 := memoryPages(32<<20, 1)
			m1 := makeSnapshot(t, origin, "job", deltaFiles(p1, memoryPages(2<<20, 2)))
			shipPipeTo(t, origin, prot, m1.ID, SendOptions{}, ReceiveOptions{ShareBlocks: share})
			m2 := makeSnapshot(t, origin, "job", deltaFiles(rewritePages(p1, 10, 3), memoryPages(2<<20, 2)))
			before := usedBytes(t, prot.Path("job", m1.ID))
			sent, got := shipPipeTo(t, origin, prot, m2.ID, SendOptions{}, ReceiveOptions{ShareBlocks: share})
			used := usedBytes(t, prot.Path("job", m2.ID)) - before
			t.Logf("diff against %s: %d bytes copied from the base, %d of them shared; the replica of %d bytes took %d bytes of disk",
				sent.BaseID, got.CopiedBytes, got.SharedBytes, m2.TotalSize(), used)
			if sent.BaseID != m1.ID || got.CopiedBytes < 30<<20 {
				t.Fatalf("sent against %q, %d bytes copied: want a diff against %s taking most of it", sent.BaseID, got.CopiedBytes, m1.ID)
			}
			switch {
			case share && (got.SharedBytes != got.CopiedBytes || used > m2.TotalSize()*3/10):
				t.Errorf("shared %d of %d copied bytes, %d bytes of disk for %d: want every copied byte shared, under 30%%",
					got.SharedBytes, got.CopiedBytes, used, m2.TotalSize())
			case !share && (got.SharedBytes != 0 || used < m2.TotalSize()*9/10):
				t.Errorf("without ShareBlocks: shared %d bytes, %d bytes of disk for %d: want nothing shared, every byte written",
					got.SharedBytes, used, m2.TotalSize())
			}
			if _, err := prot.Verify(context.Background(), "job", m2.ID); err != nil {
				t.Fatal(err)
			}
			for _, f := range m2.Files {
				a, _ := os.ReadFile(filepath.Join(origin.Path("job", m2.ID), f.Name))
				b, _ := os.ReadFile(filepath.Join(prot.Path("job", m2.ID), f.Name))
				if !bytes.Equal(a, b) {
					t.Errorf("%s differs between the origin and the rebuilt replica", f.Name)
				}
			}
			// The base may go: the replica's shared blocks stay its own.
			if err := prot.Delete("job", m1.ID); err != nil {
				t.Fatal(err)
			}
			if _, err := prot.Verify(context.Background(), "job", m2.ID); err != nil {
				t.Fatalf("the replica after its base was deleted: %v", err)
			}
		})
	}
}
