package ship

import (
	"crypto/sha256"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestHashPipe: the pipe's sum is the sha256 of what was written, whatever the sizes of the writes (empty,
// within one buffer, across several), file after file, also after a file abandoned half way.
func TestHashPipe(t *testing.T) {
	data := memoryPages(5*hashPipeBuffer+123, 7)
	p := newHashPipe()
	for _, chunk := range []int{4096, hashPipeBuffer - 1, hashPipeBuffer, 3*hashPipeBuffer + 5, len(data)} {
		p.start()
		for off := 0; off < len(data); off += chunk {
			p.Write(data[off:min(off+chunk, len(data))])
			p.Write(nil)
		}
		want := sha256.Sum256(data)
		if got := p.finish(); string(got) != string(want[:]) {
			t.Errorf("writes of %d bytes: sum %x, want %x", chunk, got, want)
		}
	}
	p.start()
	p.Write(data[:2*hashPipeBuffer])
	p.finish() // a failed file's sum is dropped
	p.start()
	if got, want := p.finish(), sha256.Sum256(nil); string(got) != string(want[:]) {
		t.Errorf("empty file: sum %x, want %x", got, want)
	}
}

// TestWritebackFileAllocatesAhead: a received file's blocks are allocated at most allocAhead past what was
// written (a sender announcing a huge file reserves little of the disk), and its size is what was written.
func TestWritebackFileAllocatesAhead(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "pages-1.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w := &writebackFile{f: f, size: 1 << 40}
	if _, err := w.Write(make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != 1<<20 {
		t.Errorf("size %d after 1 MiB written", fi.Size())
	}
	if alloc := fi.Sys().(*syscall.Stat_t).Blocks * 512; alloc > 1<<20+allocAhead {
		t.Errorf("%d bytes allocated after 1 MiB written of a file announced as 1 TiB; want at most %d", alloc, 1<<20+allocAhead)
	}
}
