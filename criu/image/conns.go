package image

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"slices"

	sk_inet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"

	"github.com/ftkit/ftkit/tcpflow"
)

// TCPConn is one connected TCP socket of a dump: its 4-tuple from files.img
// and its repair state from tcp-stream-<ino>.img. Sequence numbers are those
// of the local socket: Inq* describe bytes received from Remote, Outq* bytes
// sent to it.
type TCPConn struct {
	Inode uint32
	State uint32 // Linux TCP state: 1 ESTABLISHED, 2 SYN_SENT, 4/5 FIN_WAIT1/2, 8 CLOSE_WAIT, ...
	tcpflow.Tuple

	InqSeq  uint32 // rcv_nxt: sequence number after the last byte received
	InqLen  uint32 // bytes received, not yet read by the application
	OutqSeq uint32 // write_seq: sequence number after the last byte written
	OutqLen uint32 // bytes written, not yet acknowledged
	UnsqLen uint32 // of OutqLen, bytes never transmitted

	HasWindow bool // false if the kernel gave CRIU no TCP_REPAIR_WINDOW data
	SndWl1    uint32
	SndWnd    uint32
	MaxWindow uint32
	RcvWnd    uint32
	RcvWup    uint32

	HasTimestamp bool   // TCP timestamps negotiated
	Timestamp    uint32 // TCP_TIMESTAMP value; low bit set means microsecond TSval (Linux 6.7+)
	MSS          uint32 // mss_clamp
	HasWscale    bool
	SndWscale    uint32
	RcvWscale    uint32

	SoSndbuf uint32 // SO_SNDBUF as getsockopt reports it (twice the value setsockopt takes)
	SoRcvbuf uint32
}

// Connecting says the socket was still connecting (SYN_SENT) when it was dumped: CRIU keeps it, and its
// restore connects again, but nothing was exchanged and InqSeq is the kernel's placeholder 0, not a
// sequence number of the peer's stream.
func (c TCPConn) Connecting() bool { return c.State == tcpSynSent }

// FinUnacked says the socket had sent (or queued) its FIN and the peer had not acknowledged it when it was
// dumped (FIN_WAIT1, CLOSING, LAST_ACK). CRIU (libsoccr) leaves the FIN in OutqSeq, the kernel's write_seq,
// but takes it out of OutqLen: the socket's snd_una is OutqSeq-OutqLen-1.
func (c TCPConn) FinUnacked() bool {
	return c.State == tcpFinWait1 || c.State == tcpClosing || c.State == tcpLastAck
}

// TCPConnections lists every connected TCP socket in the dump at dir (those
// CRIU wrote a tcp-stream image for; filter on State for ESTABLISHED only),
// sorted by inode. An established socket without its tcp-stream image is an
// error: the dump is incomplete.
func TCPConnections(dir string) ([]TCPConn, error) {
	f, err := readFiles(dir)
	if err != nil {
		return nil, err
	}
	var out []TCPConn
	seen := map[uint32]int{}
	for _, i := range f.tcpSockets() {
		sk := f.entries[i].GetIsk()
		// A socket has one entry (Apply refuses two as well): each copy of it had its stream read again, and
		// an image from another node with 2^21 copies of one large stream would hold the restore for hours.
		if j, ok := seen[sk.GetIno()]; ok {
			return nil, fmt.Errorf("image %s: two TCP sockets with inode %d (entries #%d and #%d): %w", filesName, sk.GetIno(), j, i, ErrFormat)
		}
		seen[sk.GetIno()] = i
		path := tcpStreamPath(dir, sk.GetIno())
		b, err := os.ReadFile(path)
		if errors.Is(err, fs.ErrNotExist) {
			if sk.GetState() == tcpEstablish {
				return nil, fmt.Errorf("established TCP socket inode %d has no %s (dumped without --tcp-established?): %w",
					sk.GetIno(), tcpStreamName(sk.GetIno()), err)
			}
			continue // listening or closed socket: nothing to repair
		}
		if err != nil {
			return nil, fmt.Errorf("read CRIU image: %w", err)
		}
		s, err := decodeTCPStream(tcpStreamName(sk.GetIno()), b)
		if err != nil {
			return nil, err
		}
		c, err := newTCPConn(sk, s)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b TCPConn) int { return cmp.Compare(a.Inode, b.Inode) })
	return out, nil
}

// SendQueue returns the send queue of the TCP socket inode in the dump at dir: the bytes the application
// had written and the peer had not acknowledged, ending at outq_seq (TCPConn.OutqSeq).
func SendQueue(dir string, inode uint32) ([]byte, error) {
	s, err := readTCPStream(dir, inode)
	if err != nil {
		return nil, err
	}
	return s.outq, nil
}

// ReceiveQueue returns the receive queue of the TCP socket inode in the dump at dir: the bytes the peer had
// sent and the application had not yet read, ending at inq_seq (TCPConn.InqSeq), so the first of them has
// sequence number InqSeq-InqLen (mod 2^32). Read them before ClearReceive to deliver them later.
func ReceiveQueue(dir string, inode uint32) ([]byte, error) {
	s, err := readTCPStream(dir, inode)
	if err != nil {
		return nil, err
	}
	return s.inq, nil
}

// readTCPStream reads and decodes the tcp-stream image of socket inode in the dump at dir.
func readTCPStream(dir string, inode uint32) (*tcpStream, error) {
	b, err := os.ReadFile(tcpStreamPath(dir, inode))
	if err != nil {
		return nil, fmt.Errorf("read CRIU image: %w", err)
	}
	return decodeTCPStream(tcpStreamName(inode), b)
}

func newTCPConn(sk *sk_inet.InetSkEntry, s *tcpStream) (TCPConn, error) {
	local, err := addrPort(sk, sk.GetSrcAddr(), sk.GetSrcPort(), "src")
	if err != nil {
		return TCPConn{}, err
	}
	remote, err := addrPort(sk, sk.GetDstAddr(), sk.GetDstPort(), "dst")
	if err != nil {
		return TCPConn{}, err
	}
	e := s.entry
	return TCPConn{
		Inode: sk.GetIno(), State: sk.GetState(), Tuple: tcpflow.Tuple{Local: local, Remote: remote},
		InqSeq: e.GetInqSeq(), InqLen: e.GetInqLen(),
		OutqSeq: e.GetOutqSeq(), OutqLen: e.GetOutqLen(), UnsqLen: e.GetUnsqLen(),
		HasWindow: e.SndWnd != nil,
		SndWl1:    e.GetSndWl1(), SndWnd: e.GetSndWnd(), MaxWindow: e.GetMaxWindow(),
		RcvWnd: e.GetRcvWnd(), RcvWup: e.GetRcvWup(),
		HasTimestamp: e.GetOptMask()&tcpiOptTimestamps != 0, Timestamp: e.GetTimestamp(),
		MSS:       e.GetMssClamp(),
		HasWscale: e.GetOptMask()&tcpiOptWscale != 0, SndWscale: e.GetSndWscale(), RcvWscale: e.GetRcvWscale(),
		SoSndbuf: sk.GetOpts().GetSoSndbuf(), SoRcvbuf: sk.GetOpts().GetSoRcvbuf(),
	}, nil
}

// addrPort converts CRIU's address words: the raw in_addr/in6_addr bytes
// memcpy'd into uint32s, so they are in the dumping host's byte order (CRIU
// images are not portable across architectures anyway).
func addrPort(sk *sk_inet.InetSkEntry, words []uint32, port uint32, field string) (netip.AddrPort, error) {
	var raw []byte
	for _, w := range words {
		raw = binary.NativeEndian.AppendUint32(raw, w)
	}
	var want int
	switch sk.GetFamily() {
	case afInet:
		want = 4
	case afInet6:
		want = 16
	default:
		return netip.AddrPort{}, fmt.Errorf("image %s: socket inode %d: field family is %d, not AF_INET or AF_INET6: %w", filesName, sk.GetIno(), sk.GetFamily(), ErrFormat)
	}
	if len(raw) != want || port > 0xffff {
		return netip.AddrPort{}, fmt.Errorf("image %s: socket inode %d: field %s_addr has %d bytes and %s_port is %d, want %d bytes and a 16-bit port: %w",
			filesName, sk.GetIno(), field, len(raw), field, port, want, ErrFormat)
	}
	addr, _ := netip.AddrFromSlice(raw)
	return netip.AddrPortFrom(addr, uint16(port)), nil
}
