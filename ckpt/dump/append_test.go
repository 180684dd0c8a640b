package dump

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/regfile"
	"google.golang.org/protobuf/proto"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
)

// filesDumper stands in for CRIU: it writes a files.img holding the regular-file entries it is given.
type filesDumper struct{ regs []*regfile.RegFileEntry }

func (d *filesDumper) Dump(_ context.Context, opts criu.DumpOptions) (criu.DumpStats, error) {
	b := binary.LittleEndian.AppendUint32(nil, 0x54564319)
	b = binary.LittleEndian.AppendUint32(b, 0x56303138)
	for _, r := range d.regs {
		e, err := proto.Marshal(&fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum(), Id: proto.Uint32(r.GetId()), Reg: r})
		if err != nil {
			return criu.DumpStats{}, err
		}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(e)))
		b = append(b, e...)
	}
	return criu.DumpStats{}, os.WriteFile(filepath.Join(opts.ImagesDir, "files.img"), b, 0o600)
}

// regEntry is a file entry as a CRIU without ftkit's patch 0009 writes it: no size for a file open
// write-only with O_APPEND (should_check_size: it takes it for a log), nor for anything but a regular file.
func regEntry(id uint32, path string, flags, mode uint32) *regfile.RegFileEntry {
	r := &regfile.RegFileEntry{
		Id: proto.Uint32(id), Flags: proto.Uint32(flags), Pos: proto.Uint64(5), Name: proto.String(path), Mode: proto.Uint32(mode),
		Fown: &fown.FownEntry{Uid: proto.Uint32(0), Euid: proto.Uint32(0), Signum: proto.Uint32(0), PidType: proto.Uint32(0), Pid: proto.Uint32(0)},
	}
	if mode&syscall.S_IFMT == syscall.S_IFREG && (flags&syscall.O_ACCMODE != syscall.O_WRONLY || flags&syscall.O_APPEND == 0) {
		r.Size = proto.Uint64(5)
	}
	return r
}

// A file the job writes with no size in the images (CRIU without patch 0009: write-only with O_APPEND)
// would let no restore cut what the job appended after the snapshot: the restored job would write it a
// second time. The snapshot must be refused, naming the file, not taken with the file left out of the
// recovery contract.
func TestTakeRefusesUnsizedWrittenFile(t *testing.T) {
	const appendFlags = syscall.O_WRONLY | syscall.O_APPEND | syscall.O_LARGEFILE
	for _, tc := range []struct {
		name   string
		reg    *regfile.RegFileEntry
		refuse bool
	}{
		{"write-only appended regular file", regEntry(1, "/home/u/run.log", appendFlags, syscall.S_IFREG|0o644), true},
		{"appended regular file of unknown mode", func() *regfile.RegFileEntry {
			r := regEntry(1, "/home/u/run.log", appendFlags, syscall.S_IFREG|0o644)
			r.Mode = nil
			return r
		}(), true},
		{"write-only appended /dev/null", regEntry(1, "/dev/null", appendFlags, syscall.S_IFCHR|0o666), false},
		{"read-write appended regular file", regEntry(1, "/home/u/db", syscall.O_RDWR|syscall.O_APPEND, syscall.S_IFREG|0o644), false},
		{"write-only regular file", regEntry(1, "/home/u/out", syscall.O_WRONLY, syscall.S_IFREG|0o644), false},
		{"read-only appended regular file", regEntry(1, "/usr/lib/x", syscall.O_RDONLY|syscall.O_APPEND, syscall.S_IFREG|0o644), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: "n1"})
			if err != nil {
				t.Fatal(err)
			}
			m, err := Take(context.Background(), store, &filesDumper{regs: []*regfile.RegFileEntry{tc.reg}}, Options{Job: "job-0123abcd", PID: 1,
				Info: ckpt.Info{CRIUVersion: "4.2.1", KernelRelease: "6.18.0-test", Mode: ckpt.ModeUncoordinated}})
			switch {
			case tc.refuse && err == nil:
				t.Fatalf("Take = snapshot with open files %+v; want a refusal naming %s (the restored job would append again what it appended after the snapshot)", m.OpenFiles, tc.reg.GetName())
			case tc.refuse && (!strings.Contains(err.Error(), tc.reg.GetName()) || !strings.Contains(err.Error(), "patch 0009")):
				t.Errorf("Take = %v; want a refusal naming %s and patch 0009", err, tc.reg.GetName())
			case !tc.refuse && err != nil:
				t.Fatalf("Take = %v; want a snapshot", err)
			}
			if ids, _ := store.List("job-0123abcd", ""); tc.refuse && len(ids) != 0 {
				t.Errorf("a refused snapshot is in the store: %v", ids)
			}
		})
	}
}
