package criu

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/checkpoint-restore/go-criu/v7/crit"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	"golang.org/x/sys/unix"
)

// remapRole is the child role of TestSharedMappingRemappedWritable: map a file read-only, look at the
// range's map_files link, then map another file, opened for writing, shared and writable at the same range.
const remapRole = "remap"

// remapReady is what the child writes to FTKIT_DIR/ready.json once its writable mapping is in place.
type remapReady struct{ Addr uint64 }

// TestSharedMappingRemappedWritable: a file mapped shared and writable at a range where a read-only file
// was mapped when its map_files link was first looked up is dumped as opened for writing (patches/0004).
// The kernel keeps that link's mode from the first lookup while a vma with the same range exists, so CRIU
// 4.2.1 recorded O_RDONLY, and the restore failed to map the file writable again (EACCES: ci147's
// TestHPCCCoordinated, an Open MPI job dumped every 2 s, "Can't restore ... mapping with
// 0xfffffffffffffff3").
func TestSharedMappingRemappedWritable(t *testing.T) {
	bin := requireCRIU(t, "CRIU")
	work := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	child := exec.Command(self)
	child.Env = append(os.Environ(), "FTKIT_CRIU_TEST_ROLE="+remapRole, "FTKIT_DIR="+work)
	child.Stderr = os.Stderr
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	var ready remapReady
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile(filepath.Join(work, "ready.json"))
		if err == nil && json.Unmarshal(b, &ready) == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the child did not map its files within 30s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	dir := filepath.Join(work, "img")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	if _, err := (Client{Binary: bin}).Dump(ctx, DumpOptions{PID: child.Process.Pid, ImagesDir: dir, LeaveRunning: true}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(dir, fmt.Sprintf("mm-%d.img", child.Process.Pid)))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := crit.New(f, nil, "", false, false).Decode(&mm.MmEntry{})
	if err != nil || len(img.Entries) != 1 {
		t.Fatalf("decode the mm image: %v (%d entries)", err, len(img.Entries))
	}
	for _, v := range img.Entries[0].Message.(*mm.MmEntry).GetVmas() {
		if v.GetStart() != ready.Addr {
			continue
		}
		if v.GetFdflags() != unix.O_RDWR {
			level, _ := BinaryPatchLevel(bin)
			t.Fatalf("the writable shared mapping at %#x was dumped with fdflags %#o, want O_RDWR: its restore would fail with EACCES; %s (patch level %d, want %d) lacks patches/0004",
				ready.Addr, v.GetFdflags(), bin, level, PatchLevel())
		}
		return
	}
	t.Fatalf("no vma at %#x in the dump", ready.Addr)
}

// runRemap is the child of TestSharedMappingRemappedWritable (remapRole).
func runRemap(work string) int {
	die := func(err error) int { fmt.Fprintln(os.Stderr, "remap:", err); return 1 }
	const size = 4096
	ro, rw := filepath.Join(work, "ro"), filepath.Join(work, "rw")
	for _, p := range []string{ro, rw} {
		if err := os.WriteFile(p, make([]byte, size), 0o600); err != nil {
			return die(err)
		}
	}
	f, err := os.Open(ro)
	if err != nil {
		return die(err)
	}
	b, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return die(err)
	}
	at := unsafe.Pointer(&b[0])
	addr := uintptr(at)
	// The first lookup of the range's link: the kernel gives it the mode of this read-only file.
	if _, err := os.Lstat(fmt.Sprintf("/proc/self/map_files/%x-%x", addr, addr+size)); err != nil {
		return die(err)
	}
	if err := unix.Munmap(b); err != nil {
		return die(err)
	}
	g, err := os.OpenFile(rw, os.O_RDWR, 0)
	if err != nil {
		return die(err)
	}
	p, err := unix.MmapPtr(int(g.Fd()), 0, at, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED)
	if err != nil || uintptr(p) != addr {
		return die(fmt.Errorf("map the writable file at %#x: %v (at %p)", addr, err, p))
	}
	*(*byte)(p) = 1
	j, _ := json.Marshal(remapReady{Addr: uint64(addr)})
	if err := os.WriteFile(filepath.Join(work, "ready.json.tmp"), j, 0o600); err != nil {
		return die(err)
	}
	if err := os.Rename(filepath.Join(work, "ready.json.tmp"), filepath.Join(work, "ready.json")); err != nil {
		return die(err)
	}
	for {
		time.Sleep(time.Hour)
	}
}
