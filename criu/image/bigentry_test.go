//go:build linux

package image

import (
	"encoding/binary"
	"errors"
	"syscall"
	"testing"
)

// TestEntrySizeNearUint32Max: an image over 4 GiB (a snapshot's files.img from another node may be any size
// within the snapshot's) whose entry claims 2^32-3 bytes is decoded or refused, never a panic of the root
// agent: 4 plus the claimed size wrapped around in 32 bits and sliced the entry out of bounds. The 4 GiB are
// an untouched MAP_NORESERVE mapping: the test reads only a few pages of it.
func TestEntrySizeNearUint32Max(t *testing.T) {
	const n = 1<<32 - 3
	b, err := syscall.Mmap(-1, 0, 8+4+n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS|syscall.MAP_NORESERVE)
	if err != nil {
		t.Skipf("no 4 GiB of address space to map: %v", err)
	}
	defer syscall.Munmap(b)
	copy(b, appendHeader(nil, magicFiles))
	binary.LittleEndian.PutUint32(b[8:], n) // a payload of zero bytes: field number 0, which no message has
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("decodeFiles panicked: %v", r)
		}
	}()
	if _, err := decodeFiles(filesName, b); !errors.Is(err, ErrFormat) {
		t.Fatalf("decodeFiles = %v, want ErrFormat", err)
	}
}
