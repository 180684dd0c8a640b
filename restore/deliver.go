package restore

import (
	"context"
	"fmt"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// deliverRound bounds what DeliverFromPeer injects at once.
const deliverRound = 1 << 20

// DeliverFromPeer injects payload (the peer's bytes from h.Seq on) into the local socket of conn with
// InjectFromPeer until the socket has taken in all of it, re-injecting what it dropped. A socket drops
// what lies beyond its receive window (measured: of 141312 bytes sent at once into a 70656-byte window,
// 86880 taken) and nobody else sends those bytes again: the real peer had them acknowledged by the
// failed original. The window opens as the application reads, so DeliverFromPeer re-injects from the
// socket's rcv_nxt whenever it moved or the application read (the unread bytes went down), and every
// retry otherwise. rcvNxt reports the socket's rcv_nxt (sockdiag.Lookup gives one way); it must not be
// before h.Seq. It runs in the calling thread's network namespace, as InjectFromPeer, until the bytes are
// in or ctx ends.
func DeliverFromPeer(ctx context.Context, conn tcpflow.Tuple, h PeerHeader, payload []byte,
	rcvNxt func() (nxt uint32, unread int, err error), retry time.Duration) error {
	end := h.Seq + uint32(len(payload))
	var lastNxt uint32
	lastUnread, first := 0, true
	for {
		nxt, unread, err := rcvNxt()
		if err != nil {
			return fmt.Errorf("deliver to %s: %w", conn, err)
		}
		off := nxt - h.Seq
		switch {
		case int32(nxt-h.Seq) < 0:
			return fmt.Errorf("deliver to %s: the socket's rcv_nxt %d is before the bytes to deliver (from %d): it lacks earlier bytes", conn, nxt, h.Seq)
		case int32(nxt-end) >= 0:
			return nil
		}
		if first || nxt != lastNxt || unread < lastUnread {
			seg := h
			seg.Seq = nxt
			// At most deliverRound bytes a round: a window is rarely larger, and what lies beyond it is
			// dropped anyway.
			if err := InjectFromPeer(conn, seg, payload[off:min(len(payload), int(off)+deliverRound)]); err != nil {
				return err
			}
			first = false
		}
		lastNxt, lastUnread = nxt, unread
		// Until something changes: look at once (loopback delivers within the send, so usually every byte
		// is in by now), then poll briefly, and re-inject at the latest after retry.
		deadline := time.Now().Add(retry)
		for wait := false; ; wait = true {
			if wait {
				select {
				case <-ctx.Done():
					return fmt.Errorf("deliver to %s: %d of %d bytes in: %w", conn, off, len(payload), context.Cause(ctx))
				case <-time.After(time.Millisecond):
				}
			}
			n, u, err := rcvNxt()
			if err != nil {
				return fmt.Errorf("deliver to %s: %w", conn, err)
			}
			if int32(n-end) >= 0 {
				return nil
			}
			if n != nxt || u < unread {
				break
			}
			if time.Now().After(deadline) {
				first = true // re-inject even without a change
				break
			}
		}
	}
}

// DeliverFIN delivers the peer's FIN at h.Seq (where its data ends) to conn's local socket as a segment of
// its peer, and again after each retry until finReceived says the socket took it in (a socket whose
// rcv_nxt has not reached h.Seq keeps it out of order meanwhile). A restored socket whose peer closed after
// the snapshot gets its data from the log, but not the FIN: a peer whose FIN the failed host had
// acknowledged never sends it again, and a program that reads to the end of the stream would wait forever.
func DeliverFIN(ctx context.Context, conn tcpflow.Tuple, h PeerHeader, finReceived func() (bool, error), retry time.Duration) error {
	h.Fin = true
	var again time.Time // when to inject (again)
	for {
		ok, err := finReceived()
		if err != nil {
			return fmt.Errorf("deliver the peer's FIN to %s: %w", conn, err)
		}
		if ok {
			return nil
		}
		if !time.Now().Before(again) {
			if err := InjectFromPeer(conn, h, nil); err != nil {
				return err
			}
			again = time.Now().Add(retry)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("deliver the peer's FIN to %s: %w", conn, context.Cause(ctx))
		case <-time.After(time.Millisecond):
		}
	}
}
