package ship

import (
	"bytes"
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
	if _, err := w.Write(bytes.Repeat([]byte{1}, 1<<20)); err != nil {
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

// TestWritebackFileLeavesHoles: aligned blocks of zeros are left as holes, the rest is written where it
// belongs, and finish gives the file its size when it ends in a hole.
func TestWritebackFileLeavesHoles(t *testing.T) {
	const size = 64 << 20
	data := func(n int) []byte { return bytes.Repeat([]byte{7}, n) }
	tests := []struct {
		name   string
		writes [][]byte
		// maxAlloc bounds the blocks the file takes.
		maxAlloc int64
	}{
		{name: "data, then zeros", writes: [][]byte{data(1000), make([]byte, size-1000)}, maxAlloc: 2 * holeBlock},
		{name: "zeros, then data", writes: [][]byte{make([]byte, size-1000), data(1000)}, maxAlloc: 2 * holeBlock},
		{name: "one write", writes: [][]byte{append(append(data(10), make([]byte, size-20)...), data(10)...)}, maxAlloc: 4 * holeBlock},
		{name: "unaligned writes", writes: [][]byte{data(3), make([]byte, holeBlock), make([]byte, size-holeBlock-4), data(1)}, maxAlloc: 4 * holeBlock},
		{name: "zeros not a whole block", writes: [][]byte{data(1), make([]byte, holeBlock-2), data(1), make([]byte, size-holeBlock)}, maxAlloc: 2 * holeBlock},
		{name: "dense", writes: [][]byte{data(size)}, maxAlloc: size + holeBlock},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := os.Create(filepath.Join(t.TempDir(), "stdout"))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			w := &writebackFile{f: f, size: size}
			var want []byte
			for _, p := range tc.writes {
				want = append(want, p...)
				if n, err := w.Write(p); n != len(p) || err != nil {
					t.Fatalf("Write = %d, %v; want %d", n, err, len(p))
				}
			}
			if err := w.finish(); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(f.Name())
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("file holds %d bytes that differ from the %d written", len(got), len(want))
			}
			var st syscall.Stat_t
			if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
				t.Fatal(err)
			}
			if alloc := st.Blocks * 512; alloc > tc.maxAlloc {
				t.Errorf("%d bytes allocated, want at most %d", alloc, tc.maxAlloc)
			}
		})
	}
}
