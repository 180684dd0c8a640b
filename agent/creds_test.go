package agent

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/creds"
	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"google.golang.org/protobuf/proto"
)

// writeCore writes core-<tid>.img holding c as the thread's credentials (nil: none, as a zombie's).
func writeCore(t *testing.T, dir string, tid int, c *creds.CredsEntry, dead bool) {
	t.Helper()
	core := &criucore.CoreEntry{Mtype: criucore.CoreEntry_X86_64.Enum()}
	if c != nil {
		core.ThreadCore = &criucore.ThreadCoreEntry{Creds: c}
	}
	if dead {
		core.Tc = &criucore.TaskCoreEntry{TaskState: proto.Uint32(2)}
	}
	b, err := proto.MarshalOptions{AllowPartial: true}.Marshal(core) // only what the check reads
	if err != nil {
		t.Fatal(err)
	}
	img := binary.LittleEndian.AppendUint32(nil, 0x54564319) // IMG_COMMON
	img = binary.LittleEndian.AppendUint32(img, 0x55053847)  // CORE
	img = binary.LittleEndian.AppendUint32(img, uint32(len(b)))
	if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("core-%d.img", tid)), append(img, b...), 0o600); err != nil {
		t.Fatal(err)
	}
}

func credsOf(uid, gid uint32) *creds.CredsEntry {
	return &creds.CredsEntry{Uid: proto.Uint32(uid), Euid: proto.Uint32(uid), Suid: proto.Uint32(uid), Fsuid: proto.Uint32(uid),
		Gid: proto.Uint32(gid), Egid: proto.Uint32(gid), Sgid: proto.Uint32(gid), Fsgid: proto.Uint32(gid),
		CapInh: []uint32{0, 0}, CapPrm: []uint32{0, 0}, CapEff: []uint32{0, 0}, CapBnd: []uint32{0xffffffff, 0x1ff}}
}

// A restore refuses a snapshot that would give a thread of a user's job credentials other than the user's
// (CRIU restores them as root, whatever they are): a set-uid program's root, a set-gid program's group, a
// capability, a supplementary group.
func TestCheckCredsRefusesForeign(t *testing.T) {
	const uid, gid = 1000, 1000
	for _, tt := range []struct {
		name string
		edit func(c *creds.CredsEntry) // on thread 2's credentials
		want string                    // in the error; "" for none
	}{
		{"the user's", func(c *creds.CredsEntry) {}, ""},
		{"set-uid root: effective and saved uid 0", func(c *creds.CredsEntry) { c.Euid, c.Suid, c.Fsuid = proto.Uint32(0), proto.Uint32(0), proto.Uint32(0) }, "uids 1000/0/0/0"},
		{"set-gid: another effective group", func(c *creds.CredsEntry) {
			c.Egid, c.Sgid, c.Fsgid = proto.Uint32(42), proto.Uint32(42), proto.Uint32(42)
		}, "gids 1000/42/42/42"},
		{"a file capability", func(c *creds.CredsEntry) { c.CapPrm, c.CapEff = []uint32{1 << 13, 0}, []uint32{1 << 13, 0} }, "capabilities"},
		{"supplementary groups", func(c *creds.CredsEntry) { c.Groups = []uint32{0, 6} }, "supplementary groups"},
		// A program with that file capability would gain it in full (inheritable in both).
		{"an inheritable capability", func(c *creds.CredsEntry) { c.CapInh = []uint32{1 << 13, 0} }, "inheritable [2000 0]"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			writeCore(t, dir, 1, credsOf(uid, gid), false)
			c := credsOf(uid, gid)
			tt.edit(c)
			writeCore(t, dir, 2, c, false)
			writeCore(t, dir, 3, nil, true) // a zombie
			err := checkImageCreds(dir, uid, gid)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("checkImageCreds = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), "thread 2")):
				t.Fatalf("checkImageCreds = %v, want an error naming thread 2 with %q", err, tt.want)
			}
			if err := checkImageCreds(dir, 0, 0); err != nil {
				t.Errorf("for a job of root: %v", err)
			}
		})
	}
}
