package image

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"net/netip"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
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
		for _, i := range fi.tcpSockets() {
			sk := fi.entries[i].GetIsk()
			newTCPConn(sk, &tcpStream{entry: baseStream(1, 0, 0)}) // errors fine, panics not
		}
	})
}

// FuzzDecodeFds: fdinfo images (shipped from other nodes) decode or fail, never panic; every number
// decoded is one an entry carries.
func FuzzDecodeFds(f *testing.F) {
	entry := func(fd uint32) []byte {
		return marshal(f, &fdinfo.FdinfoEntry{Id: proto.Uint32(1), Flags: proto.Uint32(0), Type: fdinfo.FdTypes_REG.Enum(), Fd: proto.Uint32(fd)})
	}
	f.Add(encodeEntries(magicFdinfo, [][]byte{entry(0), entry(3)}))
	f.Add(appendHeader(nil, magicFdinfo))
	f.Fuzz(func(t *testing.T, b []byte) {
		fds, err := decodeFds("fdinfo-1.img", b)
		if err == nil && len(fds) > len(b) {
			t.Fatalf("%d descriptors from %d bytes", len(fds), len(b))
		}
	})
}

// TestDecodeFds reads the numbers of an fdinfo image, an entry of a type go-criu does not know included,
// and refuses an entry without a number.
func TestDecodeFds(t *testing.T) {
	known := marshal(t, &fdinfo.FdinfoEntry{Id: proto.Uint32(1), Flags: proto.Uint32(0), Type: fdinfo.FdTypes_REG.Enum(), Fd: proto.Uint32(7)})
	// type 99 (field 3, varint), fd 4 (field 4): as a newer CRIU writes a type go-criu's enum lacks.
	newer := []byte{0x08, 0x02, 0x10, 0x00, 0x18, 99, 0x20, 4}
	fds, err := decodeFds("fdinfo-1.img", encodeEntries(magicFdinfo, [][]byte{known, newer}))
	if err != nil || len(fds) != 2 || !fds[7] || !fds[4] {
		t.Fatalf("decodeFds = %v, %v; want 4 and 7", fds, err)
	}
	noFd := []byte{0x08, 0x02, 0x10, 0x00, 0x18, 1}
	if _, err := decodeFds("fdinfo-1.img", encodeEntries(magicFdinfo, [][]byte{noFd})); !errors.Is(err, ErrFormat) {
		t.Fatalf("an entry without a number: %v, want ErrFormat", err)
	}
}
