package image

import (
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v7/crit/images/regfile"
	sk_inet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	sk_opts "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-opts"
	tcp_stream "github.com/checkpoint-restore/go-criu/v7/crit/images/tcp-stream"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// Builders for synthetic dumps, shaped like what CRIU 4.2.1 writes.

// baseStream is an established connection with window and timestamp data,
// queues of the given sizes, and a receive queue ending at inqSeq.
func baseStream(inqSeq uint32, inqLen, outqLen uint32) *tcp_stream.TcpStreamEntry {
	return &tcp_stream.TcpStreamEntry{
		InqLen: proto.Uint32(inqLen), InqSeq: proto.Uint32(inqSeq),
		OutqLen: proto.Uint32(outqLen), OutqSeq: proto.Uint32(5000),
		OptMask: proto.Uint32(tcpiOptTimestamps | tcpiOptWscale | 2), SndWscale: proto.Uint32(7),
		MssClamp: proto.Uint32(1460), RcvWscale: proto.Uint32(7), Timestamp: proto.Uint32(123456),
		UnsqLen: proto.Uint32(0),
		SndWl1:  proto.Uint32(inqSeq - inqLen), SndWnd: proto.Uint32(65536), MaxWindow: proto.Uint32(65536),
		RcvWnd: proto.Uint32(65536), RcvWup: proto.Uint32(inqSeq - inqLen),
	}
}

// unknownVarint is a protobuf field go-criu's protos do not declare, as a
// newer CRIU could write it.
func unknownVarint(num protowire.Number, v uint64) []byte {
	return protowire.AppendVarint(protowire.AppendTag(nil, num, protowire.VarintType), v)
}

func encodeStream(t testing.TB, e *tcp_stream.TcpStreamEntry, inq, outq []byte) []byte {
	t.Helper()
	b, err := (&tcpStream{entry: e, inq: inq, outq: outq}).encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func addrWords(a netip.Addr) []uint32 {
	raw := a.AsSlice()
	w := make([]uint32, len(raw)/4)
	for i := range w {
		w[i] = binary.NativeEndian.Uint32(raw[4*i:])
	}
	return w
}

type synthSock struct {
	inode    uint32
	state    uint32
	src, dst netip.AddrPort
	sndbuf   uint32
	unknown  []byte // unknown fields of the InetSkEntry (e.g. 4.2.1's tcp_opts)
}

func inetFileEntry(s synthSock) *fdinfo.FileEntry {
	family := uint32(afInet)
	if s.src.Addr().Is6() {
		family = afInet6
	}
	isk := &sk_inet.InetSkEntry{
		Id: proto.Uint32(s.inode + 1), Ino: proto.Uint32(s.inode), Family: proto.Uint32(family),
		Type: proto.Uint32(sockStreamTyp), Proto: proto.Uint32(ipprotoTCP), State: proto.Uint32(s.state),
		SrcPort: proto.Uint32(uint32(s.src.Port())), DstPort: proto.Uint32(uint32(s.dst.Port())),
		Flags: proto.Uint32(2), Backlog: proto.Uint32(0),
		SrcAddr: addrWords(s.src.Addr()), DstAddr: addrWords(s.dst.Addr()),
		Fown: &fown.FownEntry{Uid: proto.Uint32(0), Euid: proto.Uint32(0), Signum: proto.Uint32(0), PidType: proto.Uint32(0), Pid: proto.Uint32(0)},
		Opts: &sk_opts.SkOptsEntry{
			SoSndbuf: proto.Uint32(s.sndbuf), SoRcvbuf: proto.Uint32(131072),
			SoSndTmoSec: proto.Uint64(0), SoSndTmoUsec: proto.Uint64(0), SoRcvTmoSec: proto.Uint64(0), SoRcvTmoUsec: proto.Uint64(0),
		},
	}
	if s.unknown != nil {
		isk.ProtoReflect().SetUnknown(s.unknown)
	}
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_INETSK.Enum(), Id: proto.Uint32(s.inode + 1), Isk: isk}
}

func regFileEntry(id uint32, name string, size uint64) *fdinfo.FileEntry {
	return &fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum(), Id: proto.Uint32(id), Reg: &regfile.RegFileEntry{
		Id: proto.Uint32(id), Flags: proto.Uint32(0o2), Pos: proto.Uint64(size / 2), Name: proto.String(name),
		Size: proto.Uint64(size),
		Fown: &fown.FownEntry{Uid: proto.Uint32(0), Euid: proto.Uint32(0), Signum: proto.Uint32(0), PidType: proto.Uint32(0), Pid: proto.Uint32(0)},
	}}
}

// pidfdEntryRaw is a FileEntry of a type go-criu does not know (PIDFD = 20,
// field pidfd = 22 in CRIU 4.2.1), as raw bytes.
func pidfdEntryRaw() []byte {
	b := unknownVarint(1, 20)
	b = append(b, unknownVarint(2, 99)...)
	b = protowire.AppendTag(b, 22, protowire.BytesType)
	return protowire.AppendBytes(b, unknownVarint(1, 99))
}

func encodeFilesRaw(entries ...[]byte) []byte {
	buf := appendHeader(nil, magicFiles)
	for _, e := range entries {
		buf = appendEntry(buf, e)
	}
	return buf
}

func marshal(t testing.TB, m proto.Message) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeImage(t testing.TB, dir, name string, b []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
		t.Fatal(err)
	}
}
