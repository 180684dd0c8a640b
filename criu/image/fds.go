package image

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	remap "github.com/checkpoint-restore/go-criu/v7/crit/images/remap-file-path"
	"google.golang.org/protobuf/proto"
)

// CRIU's IDS_MAGIC, FDINFO_MAGIC, MM_MAGIC and REMAP_FPATH_MAGIC, and the VmaEntry status bits of mappings
// a restore makes from the snapshot's own copy (criu/include/image.h).
const (
	magicIDs        = 0x54432030
	magicFdinfo     = 0x56213732
	magicMm         = 0x57492820
	magicRemapFpath = 0x59133954

	vmaFilePrivate = 1 << 6
	vmaFileShared  = 1 << 7
	vmaAnonShared  = 1 << 8
	vmaSysVIPC     = 1 << 10
	vmaAioRing     = 1 << 13
	vmaMemfd       = 1 << 14
)

// Files is what the dump in a directory gives a task.
type Files struct {
	// Fds are its descriptors: at CRIU's post-restore notification, CRIU's own service descriptors are
	// still open beside them.
	Fds map[int]bool
	// NamelessFds and NamelessMaps (by start address) are its descriptors and mappings whose file the restore
	// makes from the snapshot's own copy and leaves with no name: a file deleted before the dump (CRIU's ghost
	// or linked remap), a memfd, shared anonymous or SysV memory. Any other file the restore opens by path.
	NamelessFds  map[int]bool
	NamelessMaps map[uint64]bool
	// Maps are the start addresses of all its mappings: at CRIU's post-restore notification, CRIU's own
	// mappings (shared anonymous memory) are still there beside them.
	Maps map[uint64]bool
}

// TaskFiles reads Files for task pid (its PID in the dump) of the dump in dir.
func TaskFiles(dir string, pid int) (*Files, error) {
	read := func(name string, optional bool) ([]byte, error) {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if optional && errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read CRIU image: %w", err)
		}
		return b, nil
	}
	name := fmt.Sprintf("ids-%d.img", pid)
	b, err := read(name, false)
	if err != nil {
		return nil, err
	}
	_, ids, err := decodeEntries(name, b, magicIDs, "TaskKobjIdsEntry", func() *criucore.TaskKobjIdsEntry { return &criucore.TaskKobjIdsEntry{} }, proto.UnmarshalOptions{})
	if err != nil {
		return nil, err
	}
	if len(ids) != 1 {
		return nil, fmt.Errorf("image %s: %d entries, want 1: %w", name, len(ids), ErrFormat)
	}
	fdName, mmName := fmt.Sprintf("fdinfo-%d.img", ids[0].GetFilesId()), fmt.Sprintf("mm-%d.img", pid)
	fds, err := read(fdName, false)
	if err != nil {
		return nil, err
	}
	mms, err := read(mmName, false)
	if err != nil {
		return nil, err
	}
	remaps, err := read(remapName, true) // only a dump that found deleted files has it
	if err != nil {
		return nil, err
	}
	return decodeTaskFiles(fdName, fds, mmName, mms, remaps)
}

const remapName = "remap-fpath.img"

// decodeTaskFiles builds Files from a task's fdinfo and mm images and the dump's remap-fpath image (nil if
// it has none).
func decodeTaskFiles(fdName string, fdImg []byte, mmName string, mmImg, remapImg []byte) (*Files, error) {
	remapped, err := remappedFiles(remapImg)
	if err != nil {
		return nil, err
	}
	// AllowPartial: a descriptor of a type newer than go-criu's enum (as in files.img) still has its number.
	_, fds, err := decodeEntries(fdName, fdImg, magicFdinfo, "FdinfoEntry", func() *fdinfo.FdinfoEntry { return &fdinfo.FdinfoEntry{} },
		proto.UnmarshalOptions{AllowPartial: true})
	if err != nil {
		return nil, err
	}
	out := &Files{Fds: map[int]bool{}, NamelessFds: map[int]bool{}, NamelessMaps: map[uint64]bool{}, Maps: map[uint64]bool{}}
	for i, e := range fds {
		if e.Fd == nil {
			return nil, fmt.Errorf("image %s: FdinfoEntry #%d has no descriptor number: %w", fdName, i, ErrFormat)
		}
		fd := int(e.GetFd())
		out.Fds[fd] = true
		if e.Type != nil && (e.GetType() == fdinfo.FdTypes_MEMFD || (e.GetType() == fdinfo.FdTypes_REG && remapped[e.GetId()])) {
			out.NamelessFds[fd] = true
		}
	}
	_, mms, err := decodeEntries(mmName, mmImg, magicMm, "MmEntry", func() *mm.MmEntry { return &mm.MmEntry{} }, proto.UnmarshalOptions{AllowPartial: true})
	if err != nil {
		return nil, err
	}
	for _, m := range mms {
		for _, v := range m.GetVmas() {
			out.Maps[v.GetStart()] = true
			st := v.GetStatus()
			file := st&(vmaFilePrivate|vmaFileShared) != 0
			if st&(vmaMemfd|vmaAnonShared|vmaSysVIPC|vmaAioRing) != 0 || (file && v.GetShmid() <= 0xffffffff && remapped[uint32(v.GetShmid())]) {
				out.NamelessMaps[v.GetStart()] = true
			}
		}
	}
	return out, nil
}

// remappedFiles lists the ids of the regular files the dump found deleted (remap-fpath.img: a ghost copy or
// a link CRIU made), which a restore recreates under a name it then removes.
func remappedFiles(b []byte) (map[uint32]bool, error) {
	out := map[uint32]bool{}
	if b == nil {
		return out, nil
	}
	_, ents, err := decodeEntries(remapName, b, magicRemapFpath, "RemapFilePathEntry", func() *remap.RemapFilePathEntry { return &remap.RemapFilePathEntry{} },
		proto.UnmarshalOptions{AllowPartial: true})
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if e.RemapType != nil && e.GetRemapType() == remap.RemapType_PROCFS { // a dead process's /proc file: named
			continue
		}
		out[e.GetOrigId()] = true
	}
	return out, nil
}
