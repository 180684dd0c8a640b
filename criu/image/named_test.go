package image

import (
	"errors"
	"reflect"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fifo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	sk_opts "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-opts"
	sk_unix "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-unix"
	"google.golang.org/protobuf/proto"
)

func unixFileEntry(id uint32, name, dir string, deleted bool) *fdinfo.FileEntry {
	u := &sk_unix.UnixSkEntry{
		Id: proto.Uint32(id), Ino: proto.Uint32(id + 100), Type: proto.Uint32(1), State: proto.Uint32(10),
		Flags: proto.Uint32(2), Uflags: proto.Uint32(0), Backlog: proto.Uint32(0), Peer: proto.Uint32(0),
		Fown: &fown.FownEntry{Uid: proto.Uint32(0), Euid: proto.Uint32(0), Signum: proto.Uint32(0), PidType: proto.Uint32(0), Pid: proto.Uint32(0)},
		Opts: &sk_opts.SkOptsEntry{SoSndbuf: proto.Uint32(0), SoRcvbuf: proto.Uint32(0), SoSndTmoSec: proto.Uint64(0), SoSndTmoUsec: proto.Uint64(0),
			SoRcvTmoSec: proto.Uint64(0), SoRcvTmoUsec: proto.Uint64(0)},
		Name: []byte(name),
	}
	if dir != "" {
		u.NameDir = proto.String(dir)
	}
	if deleted {
		u.Deleted = proto.Bool(true)
	}
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_UNIXSK.Enum(), Id: proto.Uint32(id), Usk: u}
}

func fifoFileEntry(id, regf uint32) *fdinfo.FileEntry {
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_FIFO.Enum(), Id: proto.Uint32(id), Fifo: &fifo.FifoEntry{Id: proto.Uint32(id), PipeId: proto.Uint32(7), RegfId: proto.Uint32(regf)}}
}

// TestNamedPaths lists the paths a restore binds sockets at and opens FIFOs by: absolute and relative
// socket names (joined to the directory they were bound from), not abstract or unbound ones, and FIFOs by
// their regular-file entry; a name with ".." or a FIFO without its entry is refused.
func TestNamedPaths(t *testing.T) {
	entries := func(es ...*fdinfo.FileEntry) []byte {
		var raw [][]byte
		for _, e := range es {
			raw = append(raw, marshal(t, e))
		}
		return encodeFilesRaw(raw...)
	}
	good := entries(
		unixFileEntry(1, "/tmp/a/sock\x00", "", false),
		unixFileEntry(2, "rel.sock", "/home/u/run", true),
		unixFileEntry(3, "\x00abstract", "", false),
		unixFileEntry(4, "", "", false),
		regFileEntry(5, "/home/u/fifo", 0),
		fifoFileEntry(6, 5),
		unixFileEntry(7, "/tmp//a/./s2\x00", "", false),
		unixFileEntry(8, "./rel2", "/home/u/run", false),
		regFileEntry(9, "/home/u/gone.fifo", 0),
		fifoFileEntry(10, 9),
	)
	f, err := decodeFiles(filesName, good)
	if err != nil {
		t.Fatal(err)
	}
	got, err := f.namedPaths(map[uint32]bool{9: true})
	if err != nil {
		t.Fatal(err)
	}
	// "//" and "." elements are the kernel's to skip, as it does at bind; a FIFO the dump found deleted is
	// made afresh at its name.
	want := []NamedPath{
		{Path: "/tmp/a/sock", Socket: true},
		{Path: "/home/u/run/rel.sock", Socket: true, Deleted: true},
		{Path: "/home/u/fifo", Flags: 0o2},
		{Path: "/tmp/a/s2", Socket: true},
		{Path: "/home/u/run/rel2", Socket: true},
		{Path: "/home/u/gone.fifo", Deleted: true, Flags: 0o2},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("namedPaths = %+v, want %+v", got, want)
	}
	for name, b := range map[string][]byte{
		"socket name with ..":       entries(unixFileEntry(1, "../etc/sock", "/home/u", false)),
		"socket directory with ..":  entries(unixFileEntry(1, "sock", "/home/u/../../etc", false)),
		"relative socket directory": entries(unixFileEntry(1, "sock", "home/u", false)),
		"relative, no directory":    entries(unixFileEntry(1, "sock", "", false)),
		"FIFO without its entry":    entries(fifoFileEntry(6, 5)),
	} {
		f, err := decodeFiles(filesName, b)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.namedPaths(nil); !errors.Is(err, ErrFormat) {
			t.Errorf("%s: %v, want ErrFormat", name, err)
		}
	}
}

// TestNamedPathsFifoWithoutRegfID: a FIFO entry without regf_id (as CRIU before regf_id wrote them) is
// opened by CRIU by the regular-file entry of the FIFO's own id (fifo.c, open_fifo_fd), not of id 0.
func TestNamedPathsFifoWithoutRegfID(t *testing.T) {
	old := fifoFileEntry(6, 0)
	old.Fifo.RegfId = nil
	b := encodeFilesRaw(marshal(t, regFileEntry(0, "/home/u/decoy", 0)), marshal(t, regFileEntry(6, "/home/u/old.fifo", 0)), marshal(t, old))
	f, err := decodeFiles(filesName, b)
	if err != nil {
		t.Fatal(err)
	}
	got, err := f.namedPaths(nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := []NamedPath{{Path: "/home/u/old.fifo", Flags: 0o2}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("namedPaths = %+v, want %+v", got, want)
	}
}
