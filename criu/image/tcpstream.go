package image

import (
	"fmt"
	"path/filepath"
	"slices"

	tcp_stream "github.com/checkpoint-restore/go-criu/v7/crit/images/tcp-stream"
	"google.golang.org/protobuf/proto"
)

// Bits of TcpStreamEntry.opt_mask (TCPI_OPT_* in linux/tcp.h).
const (
	tcpiOptTimestamps = 1
	tcpiOptWscale     = 4
)

// maxQueue bounds a queue length: a queue spanning half the 2^32 sequence
// space or more makes the kernel's before()/after() comparisons meaningless.
const maxQueue = 1<<31 - 1

// tcpStream is a decoded tcp-stream-<ino>.img.
type tcpStream struct {
	entry *tcp_stream.TcpStreamEntry
	inq   []byte // bytes received and not yet read, ending at inq_seq
	outq  []byte // bytes written and not yet acknowledged, ending at outq_seq
}

// tcpStreamName is the file CRIU writes for the socket with this inode
// (CRIU's format is "tcp-stream-%x": the inode in hex).
func tcpStreamName(inode uint32) string {
	return fmt.Sprintf("tcp-stream-%x.img", inode)
}

func tcpStreamPath(dir string, inode uint32) string {
	return filepath.Join(dir, tcpStreamName(inode))
}

// decodeTCPStream parses an image. The returned queues alias b.
func decodeTCPStream(name string, b []byte) (*tcpStream, error) {
	rest, err := readMagic(name, b, magicTCPStream)
	if err != nil {
		return nil, err
	}
	payload, rest, err := nextEntry(name, rest, 8)
	if err != nil {
		return nil, err
	}
	e := &tcp_stream.TcpStreamEntry{}
	if err := proto.Unmarshal(payload, e); err != nil {
		return nil, fmt.Errorf("image %s: TcpStreamEntry: %v: %w", name, err, ErrFormat)
	}
	inqLen, outqLen := e.GetInqLen(), e.GetOutqLen()
	if uint64(inqLen) > uint64(len(rest)) {
		return nil, fmt.Errorf("image %s: field inq_len is %d but only %d bytes follow the entry: %w", name, inqLen, len(rest), ErrFormat)
	}
	inq, rest := rest[:inqLen], rest[inqLen:]
	if uint64(outqLen) > uint64(len(rest)) {
		return nil, fmt.Errorf("image %s: field outq_len is %d but only %d bytes follow the receive queue: %w", name, outqLen, len(rest), ErrFormat)
	}
	outq, rest := rest[:outqLen], rest[outqLen:]
	if len(rest) != 0 {
		return nil, fmt.Errorf("image %s: %d bytes after the send queue (inq_len %d, outq_len %d): %w", name, len(rest), inqLen, outqLen, ErrFormat)
	}
	return &tcpStream{entry: e, inq: inq, outq: outq}, nil
}

// encode serializes the image. The entry is always re-marshalled, so a
// decode/encode round trip of a CRIU-written image is byte-identical only if
// go-criu marshals the fields as CRIU does; the tests check this on real dumps.
func (s *tcpStream) encode() ([]byte, error) {
	payload, err := proto.Marshal(s.entry)
	if err != nil {
		return nil, fmt.Errorf("marshal TcpStreamEntry: %w", err)
	}
	buf := make([]byte, 0, 12+len(payload)+len(s.inq)+len(s.outq))
	buf = appendHeader(buf, magicTCPStream)
	buf = appendEntry(buf, payload)
	buf = append(buf, s.inq...)
	return append(buf, s.outq...), nil
}

// appendReceive adds data to the end of the receive queue: the bytes then
// occupy sequence numbers [old inq_seq, new inq_seq), mod 2^32.
func (s *tcpStream) appendReceive(name string, data []byte) error {
	e := s.entry
	total, err := newQueueLen(name, "inq_len", uint64(len(s.inq)), uint64(len(data)))
	if err != nil {
		return err
	}
	s.inq = slices.Concat(s.inq, data) // never append into the decoded file buffer
	e.InqLen = proto.Uint32(total)
	e.InqSeq = proto.Uint32(e.GetInqSeq() + uint32(len(data))) // wraps mod 2^32, as TCP does
	// rcv_wup is where the receiver last advertised its window; moving it to
	// rcv_nxt re-opens the full rcv_wnd after the injected bytes.
	if e.RcvWup != nil {
		e.RcvWup = proto.Uint32(e.GetInqSeq())
	}
	return nil
}

// clearReceive empties the receive queue: rcv_nxt moves back to the first
// unread byte, and rcv_wup with it if it was after that byte, keeping the
// advertised right edge rcv_wup+rcv_wnd (see ClearReceive).
func (s *tcpStream) clearReceive(name string) error {
	e := s.entry
	n := e.GetInqLen()
	if uint64(n) != uint64(len(s.inq)) || n > maxQueue {
		return fmt.Errorf("image %s: field inq_len is %d but the receive queue holds %d bytes: %w", name, n, len(s.inq), ErrInconsistent)
	}
	start := e.GetInqSeq() - n // wraps mod 2^32, as TCP does
	s.inq = nil
	e.InqLen = proto.Uint32(0)
	e.InqSeq = proto.Uint32(start)
	if e.RcvWup != nil && seqAfter(e.GetRcvWup(), start) {
		edge := e.GetRcvWup() + e.GetRcvWnd()
		e.RcvWup = proto.Uint32(start)
		e.RcvWnd = proto.Uint32(edge - start)
	}
	return nil
}

// newQueueLen is the length of a queue of have bytes after adding add, or an
// error if that leaves the sequence space the kernel can compare in.
func newQueueLen(name, field string, have, add uint64) (uint32, error) {
	if have+add > maxQueue || add > maxQueue {
		return 0, fmt.Errorf("image %s: field %s would be %d bytes (%d + %d added), over the %d a TCP queue can span in 2^32 sequence numbers: %w",
			name, field, have+add, have, add, maxQueue, ErrInconsistent)
	}
	return uint32(have + add), nil
}

// seqAfter reports whether sequence number a is after b, mod 2^32 (the
// kernel's after()).
func seqAfter(a, b uint32) bool { return int32(b-a) < 0 }

// validate checks what CRIU and the kernel check when restoring the stream
// (criu/sk-tcp.c, soccr/soccr.c, tcp_repair_set_window in net/ipv4/tcp.c).
func (s *tcpStream) validate(name string) error {
	e := s.entry
	bad := func(format string, args ...any) error {
		return fmt.Errorf("image %s: "+format+": %w", append([]any{name}, append(args, ErrInconsistent)...)...)
	}
	switch {
	case uint64(len(s.inq)) != uint64(e.GetInqLen()):
		return bad("field inq_len is %d but the receive queue holds %d bytes", e.GetInqLen(), len(s.inq))
	case uint64(len(s.outq)) != uint64(e.GetOutqLen()):
		return bad("field outq_len is %d but the send queue holds %d bytes", e.GetOutqLen(), len(s.outq))
	case e.GetInqLen() > maxQueue:
		return bad("field inq_len %d spans half the sequence space or more", e.GetInqLen())
	case e.GetOutqLen() > maxQueue:
		return bad("field outq_len %d spans half the sequence space or more", e.GetOutqLen())
	case e.UnsqLen == nil:
		return bad("field unsq_len is missing (CRIU refuses to restore without it)")
	case e.GetUnsqLen() > e.GetOutqLen():
		return bad("field unsq_len %d exceeds outq_len %d", e.GetUnsqLen(), e.GetOutqLen())
	case e.GetOptMask()&tcpiOptTimestamps != 0 && e.Timestamp == nil:
		return bad("opt_mask has timestamps but field timestamp is missing")
	case e.GetOptMask()&tcpiOptWscale != 0 && e.RcvWscale == nil:
		return bad("opt_mask has window scaling but field rcv_wscale is missing")
	}
	if e.SndWnd == nil {
		return nil // no TCP_REPAIR_WINDOW data: CRIU restores no windows
	}
	switch {
	case e.SndWl1 == nil || e.MaxWindow == nil || e.RcvWnd == nil || e.RcvWup == nil:
		return bad("field snd_wnd is set but snd_wl1, max_window, rcv_wnd or rcv_wup is missing")
	case e.GetMaxWindow() < e.GetSndWnd():
		return bad("field max_window %d is below snd_wnd %d", e.GetMaxWindow(), e.GetSndWnd())
	case seqAfter(e.GetRcvWup(), e.GetInqSeq()):
		return bad("field rcv_wup %d is after inq_seq (rcv_nxt) %d", e.GetRcvWup(), e.GetInqSeq())
	case seqAfter(e.GetSndWl1(), e.GetInqSeq()+e.GetRcvWnd()):
		return bad("field snd_wl1 %d is after inq_seq+rcv_wnd %d", e.GetSndWl1(), e.GetInqSeq()+e.GetRcvWnd())
	}
	return nil
}
