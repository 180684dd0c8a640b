package image

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"net/netip"
	"reflect"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/creds"
	criucore "github.com/checkpoint-restore/go-criu/v7/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/mm"
	remap "github.com/checkpoint-restore/go-criu/v7/crit/images/remap-file-path"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/vma"
	"google.golang.org/protobuf/proto"
)

// FuzzDecodeTCPStream feeds arbitrary bytes to the tcp-stream decoder. It must
// never panic or allocate by a claimed length, and whatever it accepts must
// re-encode to bytes that decode to the same thing and re-encode identically.
func FuzzDecodeTCPStream(f *testing.F) {
	good := encodeStream(f, baseStream(100, 3, 2), []byte("abc"), []byte("de"))
	f.Add(good)
	f.Add(good[:len(good)-1])
	f.Add(encodeStream(f, baseStream(math.MaxUint32, 0, 0), nil, nil))
	huge := baseStream(1, math.MaxUint32, math.MaxUint32)
	f.Add(encodeStream(f, huge, nil, nil))
	f.Add(append(binary.LittleEndian.AppendUint32(appendHeader(nil, magicTCPStream), math.MaxUint32), 0, 0))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := decodeTCPStream("fuzz.img", b)
		if err != nil {
			return
		}
		if len(s.inq)+len(s.outq) > len(b) {
			t.Fatalf("queues of %d+%d bytes from a %d-byte image", len(s.inq), len(s.outq), len(b))
		}
		out, err := s.encode()
		if err != nil {
			// Only a TcpStreamEntry with required fields missing can fail, and
			// the decoder rejects those.
			t.Fatalf("encode of a decoded image: %v", err)
		}
		s2, err := decodeTCPStream("fuzz.img", out)
		if err != nil {
			t.Fatalf("re-decode: %v", err)
		}
		if !proto.Equal(s.entry, s2.entry) || !bytes.Equal(s.inq, s2.inq) || !bytes.Equal(s.outq, s2.outq) {
			t.Fatal("re-decoded image differs")
		}
		out2, err := s2.encode()
		if err != nil || !bytes.Equal(out, out2) {
			t.Fatalf("encode not stable: %v", err)
		}
		_ = s.validate("fuzz.img") // must not panic on any accepted image
	})
}

// FuzzDecodeFiles does the same for files.img, including the socket and
// regular-file views built from it.
func FuzzDecodeFiles(f *testing.F) {
	sk := synthSock{inode: 9, state: 1, sndbuf: 5, src: netip.MustParseAddrPort("[::1]:1"), dst: netip.MustParseAddrPort("[::1]:2")}
	f.Add(encodeFilesRaw(marshal(f, regFileEntry(1, "/a", 3)), marshal(f, inetFileEntry(sk)), pidfdEntryRaw()))
	f.Add(encodeFilesRaw([]byte{0x0a}))
	f.Add(appendHeader(nil, magicFiles))
	f.Fuzz(func(t *testing.T, b []byte) {
		fi, err := decodeFiles("files.img", b)
		if err != nil {
			return
		}
		if !bytes.Equal(fi.encode(), b) {
			t.Fatal("files.img re-encode differs")
		}
		fi.namedPaths(nil) // errors fine, panics not
		for _, i := range fi.tcpSockets() {
			sk := fi.entries[i].GetIsk()
			newTCPConn(sk, &tcpStream{entry: baseStream(1, 0, 0)}) // errors fine, panics not
		}
	})
}

// FuzzDecodeTaskFiles: a task's fdinfo and mm images and the dump's remap-fpath image (shipped from other
// nodes) decode or fail, never panic; every descriptor decoded is one an entry carries.
func FuzzDecodeTaskFiles(f *testing.F) {
	fd := func(n uint32, typ fdinfo.FdTypes) []byte {
		return marshal(f, &fdinfo.FdinfoEntry{Id: proto.Uint32(n), Flags: proto.Uint32(0), Type: typ.Enum(), Fd: proto.Uint32(n)})
	}
	mmImg := encodeEntries(magicMm, [][]byte{marshalPartial(f, &mm.MmEntry{Vmas: []*vma.VmaEntry{{Start: proto.Uint64(0x1000), Status: proto.Uint32(vmaAnonShared)}}})})
	f.Add(encodeEntries(magicFdinfo, [][]byte{fd(0, fdinfo.FdTypes_REG), fd(3, fdinfo.FdTypes_MEMFD)}), mmImg, encodeEntries(magicRemapFpath, nil))
	f.Add(appendHeader(nil, magicFdinfo), appendHeader(nil, magicMm), []byte(nil))
	f.Fuzz(func(t *testing.T, fds, mms, remaps []byte) {
		got, err := decodeTaskFiles("fdinfo-1.img", fds, "mm-1.img", mms, remaps)
		if err == nil && len(got.Fds) > len(fds) {
			t.Fatalf("%d descriptors from %d bytes", len(got.Fds), len(fds))
		}
	})
}

// TestDecodeTaskFiles reads the descriptors of an fdinfo image, an entry of a type go-criu does not know
// included, tells the ones a restore makes from the snapshot (a memfd, a file the dump found deleted) and
// the mappings, and refuses a descriptor without a number.
func TestDecodeTaskFiles(t *testing.T) {
	entry := func(id, n uint32, typ fdinfo.FdTypes) []byte {
		return marshal(t, &fdinfo.FdinfoEntry{Id: proto.Uint32(id), Flags: proto.Uint32(0), Type: typ.Enum(), Fd: proto.Uint32(n)})
	}
	// type 99 (field 3, varint), fd 4 (field 4): as a newer CRIU writes a type go-criu's enum lacks.
	newer := []byte{0x08, 0x02, 0x10, 0x00, 0x18, 99, 0x20, 4}
	fds := encodeEntries(magicFdinfo, [][]byte{entry(1, 7, fdinfo.FdTypes_REG), newer, entry(5, 8, fdinfo.FdTypes_MEMFD), entry(6, 9, fdinfo.FdTypes_REG)})
	vmas := []*vma.VmaEntry{
		{Start: proto.Uint64(0x1000), Status: proto.Uint32(vmaFilePrivate), Shmid: proto.Uint64(1)},
		{Start: proto.Uint64(0x2000), Status: proto.Uint32(vmaAnonShared)},
		{Start: proto.Uint64(0x3000), Status: proto.Uint32(vmaFileShared), Shmid: proto.Uint64(6)},
	}
	mms := encodeEntries(magicMm, [][]byte{marshalPartial(t, &mm.MmEntry{Vmas: vmas})})
	remaps := encodeEntries(magicRemapFpath, [][]byte{marshal(t, &remap.RemapFilePathEntry{OrigId: proto.Uint32(6), RemapId: proto.Uint32(60)})})
	got, err := decodeTaskFiles("fdinfo-1.img", fds, "mm-1.img", mms, remaps)
	if err != nil {
		t.Fatal(err)
	}
	want := &Files{
		Fds:          map[int]bool{4: true, 7: true, 8: true, 9: true},
		NamelessFds:  map[int]bool{8: true, 9: true},
		NamelessMaps: map[uint64]bool{0x2000: true, 0x3000: true},
		Maps:         map[uint64]bool{0x1000: true, 0x2000: true, 0x3000: true},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decodeTaskFiles = %+v, want %+v", got, want)
	}
	noFd := []byte{0x08, 0x02, 0x10, 0x00, 0x18, 1}
	if _, err := decodeTaskFiles("fdinfo-1.img", encodeEntries(magicFdinfo, [][]byte{noFd}), "mm-1.img", mms, nil); !errors.Is(err, ErrFormat) {
		t.Fatalf("an entry without a number: %v, want ErrFormat", err)
	}
}

// FuzzDecodeCreds: a thread's core image (shipped from other nodes), read for its credentials before a
// restore, decodes or fails, never panics.
func FuzzDecodeCreds(f *testing.F) {
	core := &criucore.CoreEntry{Mtype: criucore.CoreEntry_X86_64.Enum(), ThreadCore: &criucore.ThreadCoreEntry{
		Creds: &creds.CredsEntry{Uid: proto.Uint32(1000), Gid: proto.Uint32(1000), CapPrm: []uint32{0, 0}, Groups: []uint32{4}}}}
	f.Add(encodeEntries(magicCore, [][]byte{marshalPartial(f, core)}))
	f.Add(encodeEntries(magicCore, [][]byte{marshalPartial(f, &criucore.CoreEntry{Tc: &criucore.TaskCoreEntry{TaskState: proto.Uint32(taskDead)}})}))
	f.Add(appendHeader(nil, magicCore))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, live, err := decodeCreds("core-1.img", 1, b)
		if err == nil && live && len(c.CapPrm)+len(c.CapEff)+len(c.CapInh)+len(c.Groups) > len(b) {
			t.Fatalf("%d capability words and groups from a %d-byte image", len(c.CapPrm)+len(c.CapEff)+len(c.CapInh)+len(c.Groups), len(b))
		}
	})
}
