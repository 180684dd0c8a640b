package dump

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/regfile"
	remap "github.com/checkpoint-restore/go-criu/v7/crit/images/remap-file-path"
	"google.golang.org/protobuf/proto"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
)

// remapDumper is a filesDumper whose dump found some of the files deleted: it also writes the
// remap-fpath.img CRIU writes then (a ghost copy of the file's content, or a link it made to it).
type remapDumper struct {
	filesDumper
	remaps []*remap.RemapFilePathEntry
}

func (d *remapDumper) Dump(ctx context.Context, opts criu.DumpOptions) (criu.DumpStats, error) {
	if _, err := d.filesDumper.Dump(ctx, opts); err != nil {
		return criu.DumpStats{}, err
	}
	b := binary.LittleEndian.AppendUint32(nil, 0x54564319)
	b = binary.LittleEndian.AppendUint32(b, 0x59133954)
	for _, r := range d.remaps {
		e, err := proto.Marshal(r)
		if err != nil {
			return criu.DumpStats{}, err
		}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(e)))
		b = append(b, e...)
	}
	return criu.DumpStats{}, os.WriteFile(filepath.Join(opts.ImagesDir, "remap-fpath.img"), b, 0o600)
}

// A file the job writes and that was deleted before the dump (a scratch file, tmpfile(3), a log removed
// under the job) is no file at its old name: CRIU restores it from its own copy, with no name. Listed under
// that name, the restore refused the job ("missing ... put it back"), or cut whatever file of the user's
// now has that name back to the deleted file's size, and dropped what it cut once the restore succeeded.
func TestTakeLeavesOutDeletedFiles(t *testing.T) {
	for _, tc := range []struct {
		name string
		typ  remap.RemapType
	}{
		{"deleted: a ghost copy in the images", remap.RemapType_GHOST},
		{"deleted, another link left: a link CRIU made", remap.RemapType_LINKED},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: "n1"})
			if err != nil {
				t.Fatal(err)
			}
			d := &remapDumper{
				filesDumper: filesDumper{regs: []*regfile.RegFileEntry{
					regEntry(1, "/home/u/out", syscall.O_WRONLY, syscall.S_IFREG|0o644),
					regEntry(2, "/home/u/scratch", syscall.O_RDWR, syscall.S_IFREG|0o600),
				}},
				remaps: []*remap.RemapFilePathEntry{{OrigId: proto.Uint32(2), RemapId: proto.Uint32(3), RemapType: tc.typ.Enum()}},
			}
			m, err := Take(context.Background(), store, d, Options{Job: "job-0123abcd", PID: 1,
				Info: ckpt.Info{CRIUVersion: "4.2.1", KernelRelease: "6.18.0-test", Mode: ckpt.ModeUncoordinated}})
			if err != nil {
				t.Fatalf("Take = %v; want a snapshot", err)
			}
			if want := []ckpt.OpenFile{{Path: "/home/u/out", Size: 5}}; len(m.OpenFiles) != 1 || m.OpenFiles[0] != want[0] {
				t.Errorf("snapshot's open files %+v, want %+v: the deleted /home/u/scratch is no file at that name", m.OpenFiles, want)
			}
		})
	}
}
