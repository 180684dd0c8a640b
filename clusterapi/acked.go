package clusterapi

import (
	"fmt"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// ackedConn is a TCP connection that dates what its peer's host has received: it stamps each write with
// the time before it began and the bytes written up to its end, and the kernel's count of bytes the peer
// acknowledged (TCP_INFO's bytes_acked) then names the newest write the peer holds entirely. A heartbeat
// stream's acknowledgements so prove contact with the protector's host without a request of their own
// (a ping every interval cost each agent a request and a reply, and their wakeups).
type ackedConn struct {
	*net.TCPConn
	mu      sync.Mutex
	written uint64
	skip    int            // writes still to leave unstamped, after the ones before skipFrom
	armed   bool           // skipFrom was called: writes are stamped
	writes  []stampedWrite // oldest first; at most maxStampedWrites
	acked   time.Time      // the newest write found acknowledged so far
}

// skipFrom stamps the writes from here on, but for the next n: a heartbeat stream stamps only its beats,
// not its TLS handshake nor its request's headers, which come before the first beat (delayed up to 200 ms
// by net/http's probe of the body), so that an acknowledged write is always a beat the protector received.
func (c *ackedConn) skipFrom(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armed, c.skip = true, n
}

// stampedWrite is one write: when it began, and the connection's byte count at its end.
type stampedWrite struct {
	end uint64
	at  time.Time
}

// maxStampedWrites bounds the writes kept while none is acknowledged: dropping the oldest only makes
// Acked answer with an older write, never a newer one.
const maxStampedWrites = 1024

func (c *ackedConn) Write(b []byte) (int, error) {
	at := time.Now() // before: the bytes left no earlier than this
	n, err := c.TCPConn.Write(b)
	if n > 0 {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.written += uint64(n)
		if !c.armed || c.skip > 0 {
			if c.armed {
				c.skip--
			}
			return n, err
		}
		if len(c.writes) == maxStampedWrites {
			c.writes = append(c.writes[:0], c.writes[1:]...)
		}
		c.writes = append(c.writes, stampedWrite{end: c.written, at: at})
	}
	return n, err
}

// Acked returns the time the newest write whose every byte the peer's TCP acknowledged began: the peer's
// host was reachable at that time or later. False if none is acknowledged yet.
func (c *ackedConn) Acked() (time.Time, bool, error) {
	acked, err := c.bytesAcked()
	if err != nil {
		return time.Time{}, false, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.advance(acked)
	return at, ok, nil
}

// advance consumes the writes that acked bytes cover and returns the newest one's time.
func (c *ackedConn) advance(acked uint64) (time.Time, bool) {
	i := 0
	for i < len(c.writes) && c.writes[i].end <= acked {
		i++
	}
	if i > 0 {
		c.acked = c.writes[i-1].at
		c.writes = append(c.writes[:0], c.writes[i:]...)
	}
	return c.acked, !c.acked.IsZero()
}

// bytesAcked is the kernel's count of this connection's bytes its peer acknowledged.
func (c *ackedConn) bytesAcked() (uint64, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("acknowledged bytes: %w", err)
	}
	var info *unix.TCPInfo
	var gerr error
	if err := rc.Control(func(fd uintptr) { info, gerr = unix.GetsockoptTCPInfo(int(fd), unix.SOL_TCP, unix.TCP_INFO) }); err != nil {
		return 0, fmt.Errorf("acknowledged bytes: %w", err)
	}
	if gerr != nil {
		return 0, fmt.Errorf("acknowledged bytes: TCP_INFO: %w", gerr)
	}
	return info.Bytes_acked, nil
}
