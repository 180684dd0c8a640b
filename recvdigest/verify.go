package recvdigest

import (
	"errors"
	"fmt"
	"hash/crc32"
	"io"

	"github.com/ftkit/ftkit/tcpflow"
)

// ErrNondeterministic means a restored job re-sent bytes that differ from what its peer had received: the
// program is not deterministic, so it cannot be recovered transparently.
var ErrNondeterministic = errors.New("the restored program re-sent different bytes than its peer had already received (it is not deterministic), so it cannot be recovered transparently")

// ErrUnverified means some re-sent bytes could not be compared with what the peer had received, so the
// recovery cannot be proven correct.
var ErrUnverified = errors.New("some re-sent bytes could not be compared with what the peer had received, so the recovery cannot be proven correct")

// MismatchError names a piece whose re-sent bytes differ from those the peer received.
type MismatchError struct {
	Conn      tcpflow.Tuple
	From, To  uint32 // wire sequence range the two CRCs cover: one piece of the receiver's record
	Got, Want uint32 // CRC-32C of the re-sent bytes and of the bytes the peer received
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("connection %s: bytes [%d, %d) (TCP sequence numbers) re-sent with CRC-32C %08x, the peer received CRC-32C %08x: %v",
		e.Conn, e.From, e.To, e.Got, e.Want, ErrNondeterministic)
}

func (e *MismatchError) Unwrap() error { return ErrNondeterministic }

// UnverifiedError names re-sent bytes that could not be compared, and why.
type UnverifiedError struct {
	Conn     tcpflow.Tuple
	From, To uint32 // wire sequence range of the re-sent bytes not compared
	Reason   string
}

func (e *UnverifiedError) Error() string {
	return fmt.Sprintf("connection %s: re-sent bytes [%d, %d) (TCP sequence numbers, %d bytes) were NOT verified: %s: %v",
		e.Conn, e.From, e.To, e.To-e.From, e.Reason, ErrUnverified)
}

func (e *UnverifiedError) Unwrap() error { return ErrUnverified }

// Prefix is what the restored sender had sent of the block holding from before its snapshot: the CRC-32C
// of the bytes [from-Len, from). Len is from-BlockStart(from), or less if the connection's first byte lies
// inside that block (then the prefix starts at that byte). Known is false if the sender could not compute
// it.
type Prefix struct {
	Known bool
	Len   uint32
	CRC   uint32
}

// Verify checks the bytes [from, to) of conn that a restored sender re-sends (wire sequence numbers: from
// is its snapshot's write_seq, to the receiver's rcv_nxt) against rec, what the receiver recorded.
// prefix is needed when the receiver's piece holding from starts before it. resent writes the re-sent
// bytes [seq, seq+n) to w, from the restorer's own log; it may fail (not logged yet, trimmed).
//
// Verify returns how many bytes of [from, to) it compared and found equal; it returns nil only if that is
// all of them. A piece straddling to (the receiver recorded bytes past what it acknowledged) is compared if
// resent can supply the bytes up to the piece's end. The first mismatch stops the check and is returned
// as a *MismatchError; otherwise the first range that could not be compared is returned as an
// *UnverifiedError (the count tells how much was). A to not after from means nothing was re-sent.
func Verify(rec Received, from, to uint32, prefix Prefix, resent func(w io.Writer, seq, n uint32) error) (uint64, error) {
	length := int64(int32(to - from))
	if length <= 0 {
		return 0, nil
	}
	var first *UnverifiedError
	unverified := func(a, b int64, why string) {
		if first == nil {
			first = &UnverifiedError{Conn: rec.Conn, From: from + uint32(a), To: from + uint32(b), Reason: why}
		}
	}
	if err := rec.Validate(); err != nil {
		unverified(0, length, fmt.Sprintf("the receiver's record is malformed (%v)", err))
		return 0, first
	}
	var verified uint64
	pos := int64(0) // offset from from of the first byte not yet considered
	for i, p := range rec.Pieces {
		s := int64(int32(p.Seq - from))
		e := s + int64(p.Len)
		if e <= pos {
			continue // before from
		}
		if s >= length {
			break
		}
		if s > pos {
			if i == 0 {
				unverified(pos, s, fmt.Sprintf("the receiver's record of this flow starts at %d, after the first re-sent byte: it has no record of the bytes before", p.Seq))
			} else {
				unverified(pos, s, fmt.Sprintf("the receiver's record has a hole [%d, %d): bytes it received but its tap did not record", rec.Pieces[i-1].End(), p.Seq))
			}
			pos = s
		}
		end := min(e, length)
		crc, start := uint32(0), s
		if s < 0 {
			switch {
			case !prefix.Known:
				unverified(0, end, fmt.Sprintf("the receiver's piece [%d, %d) starts before the first re-sent byte, and the restored sender could not tell what it had sent of [%d, %d) before its snapshot",
					p.Seq, p.End(), p.Seq, from))
				pos = end
				continue
			case int64(prefix.Len) != -s:
				unverified(0, end, fmt.Sprintf("the receiver's piece [%d, %d) starts at %d, but what the restored sender had sent of that block before its snapshot starts at %d (the receiver's record and the sender's disagree on where the connection's bytes begin)",
					p.Seq, p.End(), p.Seq, from-prefix.Len))
				pos = end
				continue
			}
			crc, start = prefix.CRC, 0
		}
		w := &crcWriter{crc: crc, want: uint64(e - start)}
		err := resent(w, from+uint32(start), uint32(e-start))
		if err == nil && w.n != w.want {
			err = fmt.Errorf("it supplied %d of the %d bytes", w.n, w.want)
		}
		if err != nil {
			why := fmt.Sprintf("the restorer could not read the re-sent bytes [%d, %d): %v", from+uint32(start), p.End(), err)
			if e > length {
				why = fmt.Sprintf("the receiver recorded bytes up to %d, past what it acknowledged (%d), and the restorer could not read the re-sent bytes [%d, %d) that the check of piece [%d, %d) needs: %v",
					p.End(), to, from+uint32(start), p.End(), p.Seq, p.End(), err)
			}
			unverified(pos, end, why)
			pos = end
			continue
		}
		if w.crc != p.CRC {
			return verified, &MismatchError{Conn: rec.Conn, From: p.Seq, To: p.End(), Got: w.crc, Want: p.CRC}
		}
		verified += uint64(end - pos)
		pos = end
		if pos >= length {
			break
		}
	}
	if pos < length {
		if pos == 0 {
			unverified(0, length, "the receiver recorded none of these bytes")
		} else {
			unverified(pos, length, fmt.Sprintf("the receiver's record ends at %d, before what it acknowledged (%d)", from+uint32(pos), to))
		}
	}
	if first != nil {
		return verified, first
	}
	return verified, nil
}

// crcWriter continues a CRC-32C over what is written, refusing more than want bytes.
type crcWriter struct {
	crc     uint32
	n, want uint64
}

func (w *crcWriter) Write(b []byte) (int, error) {
	if w.n+uint64(len(b)) > w.want {
		return 0, fmt.Errorf("re-sent bytes: more than the %d requested", w.want)
	}
	w.crc = crc32.Update(w.crc, castagnoli, b)
	w.n += uint64(len(b))
	return len(b), nil
}

// VerifyFin is Verify for a sender whose FIN the receiver may have taken in: to, the receiver's rcv_nxt,
// then counts the FIN, which takes one sequence number and which the receiver's tap never records, so
// Verify alone would refuse the last one as unrecorded. ownFin is where the restored sender's FIN went
// (ownFinOK false: it sent none).
//
// If the receiver's record has its FIN at to-1, the restored sender must have re-sent its own FIN there,
// right after the same bytes: its bytes [from, to-1) are verified, and a FIN elsewhere or none is a
// difference (ErrNondeterministic). Otherwise (no FIN recorded, as from a receiver that does not report
// it, or one past to) it is Verify, which refuses a FIN it cannot see as unverified. The count is of bytes:
// the FIN is not one.
func VerifyFin(rec Received, from, to, ownFin uint32, ownFinOK bool, prefix Prefix, resent func(w io.Writer, seq, n uint32) error) (uint64, error) {
	fin := to - 1
	if rec.Fin == nil || *rec.Fin != fin || int32(fin-from) < 0 || rec.Validate() != nil {
		return Verify(rec, from, to, prefix, resent)
	}
	if !ownFinOK || ownFin != fin {
		sent := "sent no FIN"
		if ownFinOK {
			sent = fmt.Sprintf("sent its FIN at %d", ownFin)
		}
		return 0, fmt.Errorf("connection %s: the peer had received the sender's FIN at %d (TCP sequence number), and the restored sender %s: %w",
			rec.Conn, fin, sent, ErrNondeterministic)
	}
	return Verify(rec, from, fin, prefix, resent)
}
