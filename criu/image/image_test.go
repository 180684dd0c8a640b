package image

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	tcp_stream "github.com/checkpoint-restore/go-criu/v7/crit/images/tcp-stream"
	"github.com/checkpoint-restore/go-criu/v7/magic"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

func TestMagicsMatchGoCRIU(t *testing.T) {
	m := magic.LoadMagic()
	for name, v := range map[string]uint32{"IMG_COMMON": magicImgCommon, "TCP_STREAM": magicTCPStream, "FILES": magicFiles, "MNTS": magicMounts, "IDS": magicIDs, "FDINFO": magicFdinfo, "MM": magicMm, "REMAP_FPATH": magicRemapFpath} {
		if m.ByName[name] != uint64(v) {
			t.Errorf("%s: ours %#x, go-criu %#x", name, v, m.ByName[name])
		}
	}
}

func TestSeqAfter(t *testing.T) {
	for _, tc := range []struct {
		a, b uint32
		want bool
	}{
		{2, 1, true},
		{1, 2, false},
		{5, 5, false},
		{3, math.MaxUint32 - 2, true}, // 3 follows 2^32-3 across the wrap
		{math.MaxUint32 - 2, 3, false},
		// Exactly half the space apart, each is "after" the other, as with the
		// kernel's after(): why queues must stay under 2^31 bytes.
		{1 << 31, 0, true},
		{0, 1 << 31, true},
	} {
		if got := seqAfter(tc.a, tc.b); got != tc.want {
			t.Errorf("seqAfter(%d, %d) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
}

func TestTCPStreamRoundTrip(t *testing.T) {
	withUnknown := baseStream(1000, 4, 2)
	// Fields 18 and 19 stand for anything a CRIU newer than go-criu's protos adds.
	withUnknown.ProtoReflect().SetUnknown(append(unknownVarint(18, 7), unknownVarint(19, 1<<40)...))
	noWindow := baseStream(7, 0, 0)
	noWindow.SndWl1, noWindow.SndWnd, noWindow.MaxWindow, noWindow.RcvWnd, noWindow.RcvWup = nil, nil, nil, nil, nil
	for _, tc := range []struct {
		name      string
		e         *tcp_stream.TcpStreamEntry
		inq, outq []byte
	}{
		{"empty queues", baseStream(1, 0, 0), nil, nil},
		{"both queues", baseStream(1000, 4, 2), []byte("abcd"), []byte("xy")},
		{"unknown fields", withUnknown, []byte("abcd"), []byte("xy")},
		{"no window data", noWindow, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := encodeStream(t, tc.e, tc.inq, tc.outq)
			s, err := decodeTCPStream("x.img", b)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(s.inq, tc.inq) || !bytes.Equal(s.outq, tc.outq) || !proto.Equal(s.entry, tc.e) {
				t.Fatalf("decoded %v %q %q, want %v %q %q", s.entry, s.inq, s.outq, tc.e, tc.inq, tc.outq)
			}
			out, err := s.encode()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(out, b) {
				t.Errorf("re-encode differs:\n got %x\nwant %x", out, b)
			}
		})
	}
}

func TestDecodeTCPStreamErrors(t *testing.T) {
	good := encodeStream(t, baseStream(100, 3, 2), []byte("abc"), []byte("de"))
	header := appendHeader(nil, magicTCPStream)
	noMSS := baseStream(100, 0, 0)
	noMSS.MssClamp = nil
	noMSSBytes, _ := proto.MarshalOptions{AllowPartial: true}.Marshal(noMSS)
	for _, tc := range []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "too short for the 8-byte magic header"},
		{"files magic", appendHeader(nil, magicFiles), "magic"},
		{"header only", header, "too short for an entry size"},
		{"entry longer than file", binary.LittleEndian.AppendUint32(bytes.Clone(header), 1000), "entry claims 1000 bytes, only 0 follow"},
		{"huge entry size", append(binary.LittleEndian.AppendUint32(bytes.Clone(header), math.MaxUint32), 1, 2, 3), "entry claims 4294967295 bytes"},
		{"garbage protobuf", appendEntry(bytes.Clone(header), []byte{0xff, 0xff, 0xff}), "TcpStreamEntry"},
		{"missing required field", appendEntry(bytes.Clone(header), noMSSBytes), "required field"},
		{"receive queue truncated", good[:len(good)-3], "field inq_len is 3 but only 2 bytes follow"},
		{"send queue truncated", good[:len(good)-1], "field outq_len is 2 but only 1 bytes follow"},
		{"trailing bytes", append(bytes.Clone(good), 0), "1 bytes after the send queue"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeTCPStream("tcp-stream-5.img", tc.b)
			if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "tcp-stream-5.img") {
				t.Errorf("err = %v, want ErrFormat naming tcp-stream-5.img and %q", err, tc.want)
			}
		})
	}
}

func TestQueueLimit(t *testing.T) {
	for _, tc := range []struct {
		have, add uint64
		ok        bool
	}{
		{0, 0, true},
		{maxQueue - 1, 1, true},
		{maxQueue, 1, false},
		{0, 1 << 32, false},
	} {
		_, err := newQueueLen("img", "inq_len", tc.have, tc.add)
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInconsistent)) {
			t.Errorf("newQueueLen(%d, %d) err = %v, want ok=%v", tc.have, tc.add, err, tc.ok)
		}
	}
}

// synthDump writes a dump with one connection (inode 0x2a, 10.0.0.1:5000 ->
// 10.0.0.2:6000) whose images carry unknown fields, plus a regular file and a
// PIDFD entry go-criu cannot parse. It returns the dump directory.
func synthDump(t testing.TB, e *tcp_stream.TcpStreamEntry, state uint32, inq, outq []byte) string {
	t.Helper()
	dir := t.TempDir()
	e.ProtoReflect().SetUnknown(unknownVarint(18, 7))
	sk := synthSock{inode: 0x2a, state: state, sndbuf: 46080,
		src: netip.MustParseAddrPort("10.0.0.1:5000"), dst: netip.MustParseAddrPort("10.0.0.2:6000"),
		unknown: unknownVarint(20, 1)}
	writeImage(t, dir, "files.img", encodeFilesRaw(
		marshal(t, regFileEntry(1, "/tmp/out.log", 100)),
		marshal(t, inetFileEntry(sk)),
		pidfdEntryRaw()))
	writeImage(t, dir, "tcp-stream-2a.img", encodeStream(t, e, inq, outq))
	return dir
}

func readAll(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	m := map[string][]byte{}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range ents {
		b, err := os.ReadFile(filepath.Join(dir, de.Name()))
		if err != nil {
			t.Fatal(err)
		}
		m[de.Name()] = b
	}
	return m
}

func onlyConn(t *testing.T, dir string) TCPConn {
	t.Helper()
	conns, err := TCPConnections(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(conns) != 1 {
		t.Fatalf("got %d connections, want 1", len(conns))
	}
	return conns[0]
}

func TestApplyEdits(t *testing.T) {
	const wrapSeq = math.MaxUint32 - 99 // 2^32-100: a 300-byte inject wraps inq_seq to 200
	inject := []byte("injected-bytes")
	big := bytes.Repeat([]byte{0xA5}, 300)
	for _, tc := range []struct {
		name   string
		seq    uint32
		state  uint32
		edits  []Edit
		inject []byte // bytes the edits append to the receive queue
		want   func(TCPConn) TCPConn
	}{
		{"inject", 1000, tcpEstablish, []Edit{InjectReceive(inject)}, inject, func(c TCPConn) TCPConn {
			c.InqLen += uint32(len(inject))
			c.InqSeq += uint32(len(inject))
			c.RcvWup = c.InqSeq
			return c
		}},
		{"inject wraps inq_seq past 2^32", wrapSeq, tcpEstablish, []Edit{InjectReceive(big)}, big, func(c TCPConn) TCPConn {
			c.InqLen += 300
			c.InqSeq = 200
			c.RcvWup = 200
			return c
		}},
		{"inject in FIN_WAIT2", 1000, tcpFinWait2, []Edit{InjectReceive(inject)}, inject, func(c TCPConn) TCPConn {
			c.InqLen += uint32(len(inject))
			c.InqSeq += uint32(len(inject))
			c.RcvWup = c.InqSeq
			return c
		}},
		{"inject nothing", 1000, tcpEstablish, []Edit{InjectReceive(nil)}, nil, func(c TCPConn) TCPConn {
			c.RcvWup = c.InqSeq
			return c
		}},
		{"even timestamp kept", 1000, tcpEstablish, []Edit{Timestamp(777000)}, nil, func(c TCPConn) TCPConn {
			c.Timestamp = 777000
			return c
		}},
		{"odd timestamp rounded up", 1000, tcpEstablish, []Edit{Timestamp(777001)}, nil, func(c TCPConn) TCPConn {
			c.Timestamp = 777002
			return c
		}},
		{"timestamp 2^32-1 wraps to 0", 1000, tcpEstablish, []Edit{Timestamp(math.MaxUint32)}, nil, func(c TCPConn) TCPConn {
			c.Timestamp = 0
			return c
		}},
		{"windows", 1000, tcpEstablish, []Edit{Windows(6<<20, 8<<20)}, nil, func(c TCPConn) TCPConn {
			c.SndWnd, c.MaxWindow = 6<<20, 8<<20
			return c
		}},
		{"send buffer", 1000, tcpEstablish, []Edit{SendBuffer(12 << 20)}, nil, func(c TCPConn) TCPConn {
			c.SoSndbuf = 12 << 20
			return c
		}},
		{"batch across the wrap", wrapSeq, tcpEstablish,
			[]Edit{InjectReceive(big), Timestamp(41), Windows(1<<20, 1<<20), SendBuffer(1 << 22), InjectReceive(inject)},
			append(bytes.Clone(big), inject...), func(c TCPConn) TCPConn {
				c.InqLen += 300 + uint32(len(inject))
				c.InqSeq = 200 + uint32(len(inject))
				c.RcvWup = c.InqSeq
				c.Timestamp = 42
				c.SndWnd, c.MaxWindow = 1<<20, 1<<20
				c.SoSndbuf = 1 << 22
				return c
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inq, outq := []byte("queued"), []byte("out")
			dir := synthDump(t, baseStream(tc.seq, uint32(len(inq)), uint32(len(outq))), tc.state, inq, outq)
			before := readAll(t, dir)
			c0 := onlyConn(t, dir)
			if err := Apply(dir, 0x2a, tc.edits...); err != nil {
				t.Fatal(err)
			}
			if got, want := onlyConn(t, dir), tc.want(c0); got != want {
				t.Errorf("after edits:\n got %+v\nwant %+v", got, want)
			}
			s, err := readStream(dir, 0x2a)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(s.inq, append(bytes.Clone(inq), tc.inject...)) || !bytes.Equal(s.outq, outq) {
				t.Errorf("queues after edits: inq %q outq %q", s.inq, s.outq)
			}
			if u := s.entry.ProtoReflect().GetUnknown(); !bytes.Equal(u, unknownVarint(18, 7)) {
				t.Errorf("unknown field of TcpStreamEntry lost: %x", u)
			}
			checkFilesPreserved(t, before["files.img"], readAll(t, dir)["files.img"], c0.SoSndbuf)
			after := readAll(t, dir)
			if len(after) != len(before) {
				t.Errorf("files in dump: before %d, after %d (temp files left?)", len(before), len(after))
			}
			if fi, err := os.Stat(tcpStreamPath(dir, 0x2a)); err != nil || fi.Mode().Perm() != 0o600 {
				t.Errorf("tcp-stream image mode after rewrite: %v %v", fi.Mode(), err)
			}
		})
	}
}

// checkFilesPreserved checks that files.img still has every entry as before
// except so_sndbuf of the socket, down to unknown fields and raw bytes.
func checkFilesPreserved(t *testing.T, before, after []byte, origSndbuf uint32) {
	t.Helper()
	fb, err := decodeFiles("before", before)
	if err != nil {
		t.Fatal(err)
	}
	fa, err := decodeFiles("after", after)
	if err != nil {
		t.Fatal(err)
	}
	if len(fa.raw) != len(fb.raw) {
		t.Fatalf("files.img: %d entries, was %d", len(fa.raw), len(fb.raw))
	}
	for i := range fa.raw {
		if sk := fa.entries[i].GetIsk(); sk != nil {
			sk.Opts.SoSndbuf = proto.Uint32(origSndbuf)
			fa.raw[i] = marshal(t, fa.entries[i])
		}
		if !bytes.Equal(fa.raw[i], fb.raw[i]) {
			t.Errorf("files.img entry #%d changed beyond so_sndbuf:\n got %x\nwant %x", i, fa.raw[i], fb.raw[i])
		}
	}
}

func TestApplyRefused(t *testing.T) {
	mod := func(f func(e *tcp_stream.TcpStreamEntry)) func(e *tcp_stream.TcpStreamEntry) { return f }
	for _, tc := range []struct {
		name  string
		state uint32
		mod   func(e *tcp_stream.TcpStreamEntry)
		inode uint32
		edits []Edit
		want  string
		is    error
	}{
		{name: "inject after peer FIN", state: 8, edits: []Edit{InjectReceive([]byte("x"))},
			want: "TCP state 8", is: ErrInconsistent},
		{name: "timestamp not negotiated", mod: mod(func(e *tcp_stream.TcpStreamEntry) { e.OptMask = proto.Uint32(tcpiOptWscale); e.Timestamp = nil }),
			edits: []Edit{Timestamp(10)}, want: "field timestamp: the connection did not negotiate", is: ErrInconsistent},
		{name: "microsecond timestamps", mod: mod(func(e *tcp_stream.TcpStreamEntry) { e.Timestamp = proto.Uint32(1001) }),
			edits: []Edit{Timestamp(10)}, want: "microsecond", is: ErrInconsistent},
		{name: "max_window below snd_wnd", edits: []Edit{Windows(2000, 1000)}, want: "field max_window 1000 is below snd_wnd 2000", is: ErrInconsistent},
		{name: "no window data", mod: mod(func(e *tcp_stream.TcpStreamEntry) {
			e.SndWl1, e.SndWnd, e.MaxWindow, e.RcvWnd, e.RcvWup = nil, nil, nil, nil, nil
		}), edits: []Edit{Windows(2000, 3000)}, want: "snd_wnd/max_window are absent", is: ErrInconsistent},
		{name: "send buffer zero", edits: []Edit{SendBuffer(0)}, want: "field so_sndbuf 0", is: ErrInconsistent},
		{name: "send buffer over INT_MAX", edits: []Edit{SendBuffer(1 << 31)}, want: "field so_sndbuf 2147483648", is: ErrInconsistent},
		{name: "rcv_wup after inq_seq", mod: mod(func(e *tcp_stream.TcpStreamEntry) { e.RcvWup = proto.Uint32(e.GetInqSeq() + 1) }),
			edits: []Edit{Timestamp(10)}, want: "field rcv_wup 1001 is after inq_seq (rcv_nxt) 1000", is: ErrInconsistent},
		{name: "rcv_wup after inq_seq across the wrap", mod: mod(func(e *tcp_stream.TcpStreamEntry) {
			e.InqSeq = proto.Uint32(math.MaxUint32)
			e.SndWl1 = proto.Uint32(math.MaxUint32 - 10)
			e.RcvWup = proto.Uint32(3) // 4 after 2^32-1
		}), edits: []Edit{Timestamp(10)}, want: "field rcv_wup 3 is after inq_seq", is: ErrInconsistent},
		{name: "snd_wl1 beyond the receive window", mod: mod(func(e *tcp_stream.TcpStreamEntry) { e.SndWl1 = proto.Uint32(1000 + 65536 + 1) }),
			edits: []Edit{Timestamp(10)}, want: "field snd_wl1 66537 is after inq_seq+rcv_wnd", is: ErrInconsistent},
		{name: "unsq_len over outq_len", mod: mod(func(e *tcp_stream.TcpStreamEntry) { e.UnsqLen = proto.Uint32(4) }),
			edits: []Edit{Timestamp(10)}, want: "field unsq_len 4 exceeds outq_len 3", is: ErrInconsistent},
		{name: "batch: valid inject, then a bad window", edits: []Edit{InjectReceive([]byte("ok")), Windows(5, 4)},
			want: "field max_window 4 is below snd_wnd 5", is: ErrInconsistent},
		{name: "unknown inode", inode: 0x2b, edits: []Edit{Timestamp(10)}, want: "no TCP socket with inode 43"},
		{name: "zero Edit", edits: []Edit{{}}, want: "zero Edit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := baseStream(1000, 6, 3)
			if tc.mod != nil {
				tc.mod(e)
			}
			state := tc.state
			if state == 0 {
				state = tcpEstablish
			}
			inode := tc.inode
			if inode == 0 {
				inode = 0x2a
			}
			dir := synthDump(t, e, state, []byte("queued"), []byte("out"))
			before := readAll(t, dir)
			err := Apply(dir, inode, tc.edits...)
			if err == nil || !strings.Contains(err.Error(), tc.want) || (tc.is != nil && !errors.Is(err, tc.is)) {
				t.Fatalf("err = %v, want %q (%v)", err, tc.want, tc.is)
			}
			after := readAll(t, dir)
			for name, b := range before {
				if !bytes.Equal(after[name], b) {
					t.Errorf("%s changed although the edit was refused", name)
				}
			}
			if len(after) != len(before) {
				t.Errorf("dump has %d files after a refused edit, had %d", len(after), len(before))
			}
		})
	}
}

func TestWrappers(t *testing.T) {
	dir := synthDump(t, baseStream(10, 6, 3), tcpEstablish, []byte("queued"), []byte("out"))
	c0 := onlyConn(t, dir)
	steps := []struct {
		name string
		run  func() error
		want func(*TCPConn)
	}{
		{"InjectReceiveBytes", func() error { return InjectReceiveBytes(dir, 0x2a, []byte("abc")) },
			func(c *TCPConn) { c.InqLen += 3; c.InqSeq += 3; c.RcvWup = c.InqSeq }},
		{"SetTimestamp", func() error { return SetTimestamp(dir, 0x2a, 99) }, func(c *TCPConn) { c.Timestamp = 100 }},
		{"SetWindows", func() error { return SetWindows(dir, 0x2a, 7, 9) }, func(c *TCPConn) { c.SndWnd, c.MaxWindow = 7, 9 }},
		{"SetSendBuffer", func() error { return SetSendBuffer(dir, 0x2a, 5000) }, func(c *TCPConn) { c.SoSndbuf = 5000 }},
	}
	want := c0
	for _, s := range steps {
		if err := s.run(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		s.want(&want)
		if got := onlyConn(t, dir); got != want {
			t.Errorf("after %s:\n got %+v\nwant %+v", s.name, got, want)
		}
	}
}

func TestTCPConnections(t *testing.T) {
	dir := t.TempDir()
	v4 := synthSock{inode: 300, state: tcpEstablish, sndbuf: 1000,
		src: netip.MustParseAddrPort("192.168.7.1:40000"), dst: netip.MustParseAddrPort("192.168.7.2:22")}
	v6 := synthSock{inode: 20, state: tcpFinWait1, sndbuf: 2000,
		src: netip.MustParseAddrPort("[fd00::1]:1"), dst: netip.MustParseAddrPort("[fd00::2]:65535")}
	listen := synthSock{inode: 5, state: 10, src: netip.MustParseAddrPort("0.0.0.0:80"), dst: netip.MustParseAddrPort("0.0.0.0:0")}
	writeImage(t, dir, "files.img", encodeFilesRaw(
		marshal(t, inetFileEntry(v4)), marshal(t, inetFileEntry(listen)), marshal(t, inetFileEntry(v6)),
		marshal(t, regFileEntry(9, "/data/x", 4096)), pidfdEntryRaw()))
	writeImage(t, dir, tcpStreamName(300), encodeStream(t, baseStream(77, 1, 0), []byte("z"), nil))
	writeImage(t, dir, tcpStreamName(20), encodeStream(t, baseStream(88, 0, 2), nil, []byte("yy")))

	conns, err := TCPConnections(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(conns) != 2 {
		t.Fatalf("got %d connections, want 2 (the listener has no stream): %+v", len(conns), conns)
	}
	for i, tc := range []struct {
		sk              synthSock
		inqSeq, inqLen  uint32
		outqLen, sndbuf uint32
	}{
		{v6, 88, 0, 2, 2000}, // sorted by inode: 20 before 300
		{v4, 77, 1, 0, 1000},
	} {
		c := conns[i]
		if c.Inode != tc.sk.inode || c.State != tc.sk.state || c.Local != tc.sk.src || c.Remote != tc.sk.dst ||
			c.InqSeq != tc.inqSeq || c.InqLen != tc.inqLen || c.OutqLen != tc.outqLen || c.SoSndbuf != tc.sndbuf ||
			!c.HasTimestamp || !c.HasWscale || !c.HasWindow || c.MSS != 1460 {
			t.Errorf("conn %d = %+v, want %+v seq %d inq %d outq %d sndbuf %d", i, c, tc.sk, tc.inqSeq, tc.inqLen, tc.outqLen, tc.sndbuf)
		}
	}

	if q, err := SendQueue(dir, 20); err != nil || string(q) != "yy" {
		t.Errorf("SendQueue(20) = %q, %v; want \"yy\"", q, err)
	}
	if q, err := SendQueue(dir, 300); err != nil || len(q) != 0 {
		t.Errorf("SendQueue(300) = %q, %v; want empty", q, err)
	}
	// An established socket whose stream image is missing: incomplete dump.
	os.Remove(filepath.Join(dir, tcpStreamName(300)))
	_, err = TCPConnections(dir)
	if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "tcp-stream-12c.img") {
		t.Errorf("missing stream image: err = %v, want ErrNotExist naming tcp-stream-12c.img", err)
	}
}

func TestRegularFiles(t *testing.T) {
	dir := t.TempDir()
	noSize := regFileEntry(3, "/old/criu/file", 0)
	noSize.Reg.Size = nil
	writeImage(t, dir, "files.img", encodeFilesRaw(
		marshal(t, regFileEntry(1, "/tmp/a b", 1<<40)), pidfdEntryRaw(),
		marshal(t, inetFileEntry(synthSock{inode: 1, state: 1, src: netip.MustParseAddrPort("1.1.1.1:1"), dst: netip.MustParseAddrPort("2.2.2.2:2")})),
		marshal(t, noSize)))
	got, err := RegularFiles(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := []RegFile{
		{ID: 1, Path: "/tmp/a b", Size: 1 << 40, HasSize: true, Flags: 2, Pos: 1 << 39},
		{ID: 3, Path: "/old/criu/file", Flags: 2},
	}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("RegularFiles = %+v, want %+v", got, want)
	}
}

// manyEpollTargets is a FileEntry of an epoll descriptor with n empty targets (field 9 epfd, its field 4 tfd).
func manyEpollTargets(n int) []byte {
	epfd := bytes.Repeat(protowire.AppendBytes(protowire.AppendTag(nil, 4, protowire.BytesType), nil), n)
	return protowire.AppendBytes(protowire.AppendTag(nil, 9, protowire.BytesType), epfd)
}

func TestFilesImageErrors(t *testing.T) {
	regNoBody := marshal(t, regFileEntry(1, "/x", 1))
	badReg := encodeFilesRaw(marshal(t, &fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum(), Id: proto.Uint32(1)}))
	badAddr := inetFileEntry(synthSock{inode: 7, state: 1, src: netip.MustParseAddrPort("1.1.1.1:1"), dst: netip.MustParseAddrPort("2.2.2.2:2")})
	badAddr.Isk.SrcAddr = append(badAddr.Isk.SrcAddr, 5)
	for _, tc := range []struct {
		name string
		b    []byte
		call func(dir string) error
		want string
	}{
		{"missing", nil, func(d string) error { _, err := RegularFiles(d); return err }, "no such file"},
		{"wrong magic", appendHeader(nil, magicTCPStream), func(d string) error { _, err := RegularFiles(d); return err }, "magic"},
		{"truncated entry", encodeFilesRaw(regNoBody)[:20], func(d string) error { _, err := RegularFiles(d); return err }, "entry claims"},
		{"garbage entry", encodeFilesRaw([]byte{0x0a, 0xff}), func(d string) error { _, err := TCPConnections(d); return err }, "FileEntry #0 at offset 8"},
		// 4 bytes an entry, some 90 bytes of memory each decoded: bounded before the agent runs out.
		{"too many entries", append(appendHeader(nil, magicFiles), make([]byte, 4*(maxEntries+1))...), func(d string) error { _, err := TCPConnections(d); return err }, "more than 2097152 FileEntry entries"},
		// 2 bytes an empty epoll target inside one entry, some 100 bytes of memory each decoded: bounded too.
		{"too many nested messages", encodeFilesRaw(manyEpollTargets(maxMessages)), func(d string) error { _, err := TCPConnections(d); return err },
			"FileEntry #0 at offset 8 brings the image's messages over 8388608"},
		{"REG without reg", badReg, func(d string) error { _, err := RegularFiles(d); return err }, "type REG but no field reg"},
		{"5-byte IPv4 address", encodeFilesRaw(marshal(t, badAddr)), func(d string) error {
			writeImage(t, d, tcpStreamName(7), encodeStream(t, baseStream(1, 0, 0), nil, nil))
			_, err := TCPConnections(d)
			return err
		}, "field src_addr has 8 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if tc.b != nil {
				writeImage(t, dir, "files.img", tc.b)
			}
			err := tc.call(dir)
			if err == nil || !strings.Contains(err.Error(), tc.want) || (tc.b != nil && !strings.Contains(err.Error(), "files.img")) {
				t.Errorf("err = %v, want it to name files.img and say %q", err, tc.want)
			}
		})
	}
}

// TestClearReceive: the receive queue is taken out and rcv_nxt moves back to its first byte, across the
// 2^32 wrap too; the window's right edge rcv_wup+rcv_wnd stays put; ReceiveQueue returns the bytes before.
func TestClearReceive(t *testing.T) {
	const inq = "queued"
	for _, tc := range []struct {
		name   string
		state  uint32
		inqSeq uint32
		queue  string
		mod    func(e *tcp_stream.TcpStreamEntry)
		want   func(c TCPConn) TCPConn
	}{
		{"window advertised before the queue", tcpEstablish, 1000, inq, nil, func(c TCPConn) TCPConn {
			c.InqSeq, c.InqLen = 994, 0 // rcv_wup 994 is not after the new rcv_nxt: kept
			return c
		}},
		{"window advertised inside the queue", tcpEstablish, 1000, inq, func(e *tcp_stream.TcpStreamEntry) {
			e.RcvWup = proto.Uint32(1000)
		}, func(c TCPConn) TCPConn {
			c.InqSeq, c.InqLen = 994, 0
			c.RcvWup, c.RcvWnd = 994, 65536+6 // right edge 1000+65536 kept
			return c
		}},
		{"inq_seq wraps back past 2^32", tcpEstablish, 3, inq, func(e *tcp_stream.TcpStreamEntry) {
			e.RcvWup = proto.Uint32(3)
		}, func(c TCPConn) TCPConn {
			c.InqSeq, c.InqLen = math.MaxUint32-2, 0 // 3-6 mod 2^32
			c.RcvWup, c.RcvWnd = math.MaxUint32-2, 65536+6
			return c
		}},
		{"queue empty", tcpEstablish, 1000, "", nil, func(c TCPConn) TCPConn { return c }},
		{"FIN_WAIT2", tcpFinWait2, 1000, inq, nil, func(c TCPConn) TCPConn {
			c.InqSeq, c.InqLen = 994, 0
			return c
		}},
		{"no window data", tcpEstablish, 1000, inq, func(e *tcp_stream.TcpStreamEntry) {
			e.SndWl1, e.SndWnd, e.MaxWindow, e.RcvWnd, e.RcvWup = nil, nil, nil, nil, nil
		}, func(c TCPConn) TCPConn {
			c.InqSeq, c.InqLen = 994, 0
			return c
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := baseStream(tc.inqSeq, uint32(len(tc.queue)), 3)
			if tc.mod != nil {
				tc.mod(e)
			}
			dir := synthDump(t, e, tc.state, []byte(tc.queue), []byte("out"))
			c0 := onlyConn(t, dir)
			if q, err := ReceiveQueue(dir, 0x2a); err != nil || string(q) != tc.queue {
				t.Fatalf("ReceiveQueue before = %q, %v; want %q", q, err, tc.queue)
			}
			if err := ClearReceiveQueue(dir, 0x2a); err != nil {
				t.Fatal(err)
			}
			if got, want := onlyConn(t, dir), tc.want(c0); got != want {
				t.Errorf("after ClearReceive:\n got %+v\nwant %+v", got, want)
			}
			if q, err := ReceiveQueue(dir, 0x2a); err != nil || len(q) != 0 {
				t.Errorf("ReceiveQueue after = %q, %v; want empty", q, err)
			}
			if q, err := SendQueue(dir, 0x2a); err != nil || string(q) != "out" {
				t.Errorf("SendQueue after = %q, %v; want \"out\" untouched", q, err)
			}
			if c := onlyConn(t, dir); c.HasWindow && c.RcvWup+c.RcvWnd != c0.RcvWup+c0.RcvWnd {
				t.Errorf("window right edge moved from %d to %d", c0.RcvWup+c0.RcvWnd, c.RcvWup+c.RcvWnd)
			}
		})
	}
	// After the peer's FIN (CLOSE_WAIT, LAST_ACK, CLOSING) the queue cannot be re-delivered before it.
	for _, state := range []uint32{8, 9, 11} {
		dir := synthDump(t, baseStream(1000, 6, 3), state, []byte(inq), []byte("out"))
		before := readAll(t, dir)
		err := ClearReceiveQueue(dir, 0x2a)
		if !errors.Is(err, ErrInconsistent) || !strings.Contains(err.Error(), fmt.Sprintf("TCP state %d", state)) {
			t.Errorf("state %d: err = %v, want ErrInconsistent naming the state", state, err)
		}
		for name, b := range readAll(t, dir) {
			if !bytes.Equal(b, before[name]) {
				t.Errorf("state %d: %s changed although the edit was refused", state, name)
			}
		}
	}
}

// TestConnecting: a socket CRIU dumped while it was connecting (SYN_SENT, which CRIU keeps and connects
// again at the restore) says so; its InqSeq is the kernel's placeholder, no point of the peer's stream.
func TestConnecting(t *testing.T) {
	for _, tc := range []struct {
		state uint32
		want  bool
	}{{tcpEstablish, false}, {tcpSynSent, true}, {tcpFinWait1, false}} {
		dir := synthDump(t, baseStream(1000, 0, 0), tc.state, nil, nil)
		if got := onlyConn(t, dir).Connecting(); got != tc.want {
			t.Errorf("state %d: Connecting() = %v, want %v", tc.state, got, tc.want)
		}
	}
}

// TestFinUnacked: a socket dumped with its FIN sent but not acknowledged (FIN_WAIT1, CLOSING, LAST_ACK)
// says so: CRIU's outq_seq counts that FIN and its outq_len does not.
func TestFinUnacked(t *testing.T) {
	for _, tc := range []struct {
		state uint32
		want  bool
	}{{tcpEstablish, false}, {tcpSynSent, false}, {tcpFinWait1, true}, {tcpFinWait2, false}, {8 /* CLOSE_WAIT */, false}, {tcpLastAck, true}, {tcpClosing, true}} {
		dir := synthDump(t, baseStream(1000, 0, 0), tc.state, nil, nil)
		if got := onlyConn(t, dir).FinUnacked(); got != tc.want {
			t.Errorf("state %d: FinUnacked() = %v, want %v", tc.state, got, tc.want)
		}
	}
}

// TestTCPConnectionsRefusesDuplicateInode: a files.img (from another node) that holds the same TCP socket
// twice is refused, as Apply refuses it, before any stream is read: each copy had its tcp-stream image read
// and decoded again (2^21 copies of one large stream would hold the restoring agent for hours) and the
// connection was listed twice.
func TestTCPConnectionsRefusesDuplicateInode(t *testing.T) {
	dir := t.TempDir()
	sk := synthSock{inode: 300, state: tcpEstablish, sndbuf: 1000,
		src: netip.MustParseAddrPort("192.168.7.1:40000"), dst: netip.MustParseAddrPort("192.168.7.2:22")}
	e := marshal(t, inetFileEntry(sk))
	writeImage(t, dir, "files.img", encodeFilesRaw(e, marshal(t, regFileEntry(9, "/data/x", 4096)), e))
	writeImage(t, dir, tcpStreamName(300), encodeStream(t, baseStream(77, 1, 0), []byte("z"), nil))
	conns, err := TCPConnections(dir)
	if !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), "two TCP sockets with inode 300 (entries #0 and #2)") {
		t.Fatalf("TCPConnections = %+v, %v; want ErrFormat naming both entries of inode 300", conns, err)
	}
}
