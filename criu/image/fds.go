package image

import (
	"fmt"
	"os"
	"path/filepath"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"google.golang.org/protobuf/proto"
)

// CRIU's IDS_MAGIC and FDINFO_MAGIC.
const (
	magicIDs    = 0x54432030
	magicFdinfo = 0x56213732
)

// TaskFds lists the descriptors the dump in dir gave task pid (its PID in the dump): the ones a restore
// gives it, beside which CRIU's own service descriptors sit until the tasks resume.
func TaskFds(dir string, pid int) (map[int]bool, error) {
	name := fmt.Sprintf("ids-%d.img", pid)
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return nil, fmt.Errorf("read CRIU image: %w", err)
	}
	_, ids, err := decodeEntries(name, b, magicIDs, "TaskKobjIdsEntry", func() *criucore.TaskKobjIdsEntry { return &criucore.TaskKobjIdsEntry{} }, proto.UnmarshalOptions{})
	if err != nil {
		return nil, err
	}
	if len(ids) != 1 {
		return nil, fmt.Errorf("image %s: %d entries, want 1: %w", name, len(ids), ErrFormat)
	}
	name = fmt.Sprintf("fdinfo-%d.img", ids[0].GetFilesId())
	if b, err = os.ReadFile(filepath.Join(dir, name)); err != nil {
		return nil, fmt.Errorf("read CRIU image: %w", err)
	}
	return decodeFds(name, b)
}

// decodeFds reads the descriptor numbers of fdinfo image name.
func decodeFds(name string, b []byte) (map[int]bool, error) {
	// AllowPartial: a descriptor of a type newer than go-criu's enum (as in files.img) still has its number.
	_, fds, err := decodeEntries(name, b, magicFdinfo, "FdinfoEntry", func() *fdinfo.FdinfoEntry { return &fdinfo.FdinfoEntry{} },
		proto.UnmarshalOptions{AllowPartial: true})
	if err != nil {
		return nil, err
	}
	out := make(map[int]bool, len(fds))
	for i, e := range fds {
		if e.Fd == nil {
			return nil, fmt.Errorf("image %s: FdinfoEntry #%d has no descriptor number: %w", name, i, ErrFormat)
		}
		out[int(e.GetFd())] = true
	}
	return out, nil
}
