package image

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"google.golang.org/protobuf/proto"
)

// magicCore is CORE_MAGIC: core-<tid>.img, one per thread of the dump.
const magicCore = 0x55053847

// taskDead is CRIU's TASK_DEAD (a zombie), whose core holds no credentials.
const taskDead = 2

// ThreadCreds are the credentials a restore gives one thread of the dump (its core image).
type ThreadCreds struct {
	TID                    int // in the dump's PID namespace
	UID, EUID, SUID, FSUID uint32
	GID, EGID, SGID, FSGID uint32
	// CapPrm, CapEff and CapInh are as the image has them (a set is empty when every word is 0); an
	// ambient capability is also a permitted one.
	CapPrm, CapEff, CapInh []uint32
	Groups                 []uint32
}

// Credentials reads the credentials of every live thread of the dump in dir, from its core images: CRIU
// restores each thread with them, as root, whatever they are.
func Credentials(dir string) ([]ThreadCreds, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read CRIU images: %w", err)
	}
	var out []ThreadCreds
	for _, e := range ents {
		num, core := strings.CutPrefix(e.Name(), "core-")
		num, img := strings.CutSuffix(num, ".img")
		tid, err := strconv.Atoi(num)
		if !core || !img || err != nil || tid <= 0 {
			continue // not a thread's core image
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("read CRIU image: %w", err)
		}
		c, live, err := decodeCreds(e.Name(), tid, b)
		if err != nil {
			return nil, err
		}
		if live {
			out = append(out, c)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].TID < out[j].TID })
	return out, nil
}

// decodeCreds decodes thread tid's core image b (named name); live is false for a zombie, which has none.
func decodeCreds(name string, tid int, b []byte) (c ThreadCreds, live bool, err error) {
	_, cores, err := decodeEntries(name, b, magicCore, "CoreEntry", func() *criucore.CoreEntry { return &criucore.CoreEntry{} },
		proto.UnmarshalOptions{AllowPartial: true})
	if err != nil {
		return ThreadCreds{}, false, err
	}
	if len(cores) != 1 {
		return ThreadCreds{}, false, fmt.Errorf("image %s: %d entries, want 1: %w", name, len(cores), ErrFormat)
	}
	cr := cores[0].GetThreadCore().GetCreds()
	if cr == nil {
		if cores[0].GetTc().GetTaskState() == taskDead {
			return ThreadCreds{}, false, nil // a zombie runs nothing
		}
		return ThreadCreds{}, false, fmt.Errorf("image %s: thread %d has no credentials: %w", name, tid, ErrFormat)
	}
	return ThreadCreds{TID: tid,
		UID: cr.GetUid(), EUID: cr.GetEuid(), SUID: cr.GetSuid(), FSUID: cr.GetFsuid(),
		GID: cr.GetGid(), EGID: cr.GetEgid(), SGID: cr.GetSgid(), FSGID: cr.GetFsgid(),
		CapPrm: cr.GetCapPrm(), CapEff: cr.GetCapEff(), CapInh: cr.GetCapInh(),
		Groups: cr.GetGroups()}, true, nil
}
