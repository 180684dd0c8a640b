package dump

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
)

// writingDumper stands in for CRIU: it writes an empty files.img and pages images in chunks, as the dump
// proceeds (waiting between chunks, so that a follower reads files half written), and with rewrite it
// goes back and changes the first bytes of pages-1.img at the end, as CRIU never does.
type writingDumper struct {
	pages   map[string][]byte
	rewrite bool
}

func (d *writingDumper) Dump(_ context.Context, opts criu.DumpOptions) (criu.DumpStats, error) {
	var files [8]byte
	binary.LittleEndian.PutUint32(files[:], 0x54564319)
	binary.LittleEndian.PutUint32(files[4:], 0x56303138)
	if err := os.WriteFile(filepath.Join(opts.ImagesDir, "files.img"), files[:], 0o600); err != nil {
		return criu.DumpStats{}, err
	}
	for name, b := range d.pages {
		f, err := os.Create(filepath.Join(opts.ImagesDir, name))
		if err != nil {
			return criu.DumpStats{}, err
		}
		for off := 0; off < len(b); off += 100 << 10 {
			if _, err := f.Write(b[off:min(off+100<<10, len(b))]); err != nil {
				return criu.DumpStats{}, err
			}
			time.Sleep(time.Millisecond)
		}
		if d.rewrite && name == "pages-1.img" {
			// The follower must have hashed the first bytes before they change (CI, ci334: a follower that a
			// loaded machine let fall behind read the changed bytes only, and its sum matched the file).
			if err := waitReadPast(f, 0); err != nil {
				return criu.DumpStats{}, err
			}
			if _, err := f.WriteAt([]byte("changed"), 0); err != nil {
				return criu.DumpStats{}, err
			}
		}
		f.Close()
	}
	return criu.DumpStats{}, nil
}

// waitReadPast waits until another descriptor of this process open on w's file (the follower's) has read
// past offset off.
func waitReadPast(w *os.File, off int64) error {
	path, err := filepath.EvalSymlinks(w.Name())
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		fds, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			return err
		}
		for _, e := range fds {
			fd, err := strconv.Atoi(e.Name())
			if err != nil || uintptr(fd) == w.Fd() {
				continue
			}
			if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err != nil || target != path {
				continue
			}
			info, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
			if err != nil {
				continue
			}
			var pos int64
			if _, err := fmt.Sscanf(string(info), "pos:\t%d", &pos); err == nil && pos > off {
				return nil
			}
		}
	}
	return fmt.Errorf("nothing read %s past offset %d within a minute", path, off)
}

// With HashWhileDumping the memory images are hashed as they are written and the commit records those
// sums: the snapshot verifies from disk. A dumper that rewrote bytes it had written before (CRIU does not)
// leaves a snapshot whose every verification fails, loudly, never one that restores wrong memory.
func TestTakeHashesPagesWhileDumping(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	pages := map[string][]byte{"pages-1.img": make([]byte, 3<<20+123), "pages-2.img": make([]byte, 1<<20)}
	for _, b := range pages {
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
	}
	for _, rewrite := range []bool{false, true} {
		store, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: "n1"})
		if err != nil {
			t.Fatal(err)
		}
		m, err := Take(context.Background(), store, &writingDumper{pages: pages, rewrite: rewrite}, Options{Job: "job-0123abcd", PID: 1, HashWhileDumping: true,
			Info: ckpt.Info{CRIUVersion: "4.2.1", KernelRelease: "6.18.0-test", Mode: ckpt.ModeUncoordinated}})
		if err != nil {
			t.Fatal(err)
		}
		f, ok := m.File("images/pages-1.img")
		sum := sha256.Sum256(pages["pages-1.img"])
		if !ok || f.SHA256 != hex.EncodeToString(sum[:]) || f.Size != int64(len(pages["pages-1.img"])) {
			t.Errorf("rewrite %v: manifest entry %+v, want the sum of what was written first", rewrite, f)
		}
		_, err = store.Verify(context.Background(), m.Job, m.ID)
		if rewrite != (err != nil) || (rewrite && !errors.Is(err, ckpt.ErrCorrupt)) {
			t.Errorf("rewrite %v: Verify = %v", rewrite, err)
		}
	}
}
