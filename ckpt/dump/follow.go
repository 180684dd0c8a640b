package dump

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftkit/ftkit/ckpt"
)

// A pagesFollower hashes CRIU's memory images (pages-*.img) while the dump writes them, so that the commit
// need not read them again once the dump is over: on this 2-vCPU machine that pass was 40-60 ms per
// 100 MiB, all of it inside a migration's stop, while CRIU itself runs on one CPU.
//
// It relies on two facts. CRIU writes each pages image once, from its start to its end (each page pipe is
// spliced at the file's end), and a reader sees a byte of a regular file only once it is written (the
// kernel grows the file's size after copying the data in), so every byte read at any moment is final. Were
// the first ever false, the recorded sha256 would not match the file and every verification of the
// snapshot (the commit's size check, each protector's receive, every restore's Verify) would refuse it:
// a loud failure, never a wrong restore.
type pagesFollower struct {
	dir   string
	files map[string]*followed
	stop  chan struct{}
	done  chan error
	buf   []byte
}

type followed struct {
	f *os.File
	h hash.Hash
	n int64
}

// writebackEvery is how many bytes the follower hashes between two starts of an image's writeback.
const writebackEvery = 8 << 20

// followPollInterval is how often the follower looks for more bytes while the dump runs.
const followPollInterval = 2 * time.Millisecond

// isPagesImage says whether name is one of CRIU's memory images.
func isPagesImage(name string) bool {
	return strings.HasPrefix(name, "pages-") && strings.HasSuffix(name, ".img")
}

// followPages starts hashing the pages images CRIU writes into dir.
func followPages(dir string) *pagesFollower {
	fl := &pagesFollower{dir: dir, files: map[string]*followed{}, stop: make(chan struct{}), done: make(chan error, 1), buf: make([]byte, 1<<20)}
	go func() {
		for {
			if err := fl.catchUp(); err != nil {
				fl.done <- err
				return
			}
			select {
			case <-fl.stop:
				fl.done <- nil
				return
			case <-time.After(followPollInterval):
			}
		}
	}()
	return fl
}

// catchUp opens the pages images that appeared and hashes what was written of each since the last call.
func (fl *pagesFollower) catchUp() error {
	ents, err := os.ReadDir(fl.dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		name := e.Name()
		if !e.Type().IsRegular() || !isPagesImage(name) {
			continue
		}
		fw, ok := fl.files[name]
		if !ok {
			f, err := os.Open(filepath.Join(fl.dir, name))
			if err != nil {
				return err
			}
			fw = &followed{f: f, h: sha256.New()}
			fl.files[name] = fw
		}
		// The disk writes the image while the dump goes on, from what CRIU wrote so far, not only what is
		// hashed (the hash falls behind CRIU when both share the CPUs): the commit's fsync, and before it
		// any fsync that waits for the journal, then find it written (100 MiB took 45 ms to write back here).
		ckpt.StartWriteback(fw.f)
		for since := int64(0); ; {
			k, err := fw.f.Read(fl.buf)
			fw.h.Write(fl.buf[:k])
			fw.n += int64(k)
			if errors.Is(err, io.EOF) || (err == nil && k == 0) {
				break
			}
			if err != nil {
				return fmt.Errorf("read %s: %w", name, err)
			}
			if since += int64(k); since >= writebackEvery {
				ckpt.StartWriteback(fw.f)
				since = 0
			}
		}
	}
	return nil
}

// finish is called once the dump has returned (CRIU has exited: nothing writes the images any more). It
// hashes what is left of every pages image and returns each one's size and sha256 by name; on an error
// (the commit then hashes the files itself) the map is nil.
func (fl *pagesFollower) finish() (map[string]hashed, error) {
	close(fl.stop)
	err := <-fl.done
	if err == nil {
		err = fl.catchUp()
	}
	out := map[string]hashed{}
	for name, fw := range fl.files {
		fw.f.Close()
		out[name] = hashed{size: fw.n, sha256: hex.EncodeToString(fw.h.Sum(nil))}
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

type hashed struct {
	size   int64
	sha256 string
}
