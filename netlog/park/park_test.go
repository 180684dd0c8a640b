//go:build linux

package park

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
)

// TestParkQueuesByMark sends frames out of the park with marks, as the log's program marks each clone
// with its queue, and checks what the design rests on: the frames of each mark wait in its queue, in the
// order sent; Free and Take give them back, headers or whole; a full queue refuses a frame at once (with
// no qdisc the sender learns it, so the program can copy the segment instead); an empty one says so;
// Close removes the device.
func TestParkQueuesByMark(t *testing.T) {
	l := labtest.New(t, 1, 0)
	const queues, qlen = 4, 8
	p, sock := openTestPark(t, l, "ftparktest0", queues, qlen)
	if err := l.Do("node1", func() error {
		if _, err := Open("ftparktest0", 1, 1); err == nil {
			return errors.New("a second park of the same name opened")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	payload := func(q, i int) []byte { return bytes.Repeat([]byte(fmt.Sprintf("q %d frame %d;", q, i)), 100) }
	// send sends frame i marked q.
	send := func(q, i int) error {
		if err := sendMarked(sock, p, q, uint32(q<<16|i), payload(q, i)); err != nil {
			return fmt.Errorf("frame %d marked %d: %w", i, q, err)
		}
		return nil
	}
	// sendTo sends frames i = 0..n-1 marked q; it returns the first error.
	sendTo := func(q, n int) error {
		for i := range n {
			if err := send(q, i); err != nil {
				return err
			}
		}
		return nil
	}
	// Interleaved, as CPUs and destinations send at once.
	for i := range 5 {
		for q := range queues {
			if err := send(q, i); err != nil {
				t.Fatal(err)
			}
		}
	}
	hdr, buf := make([]byte, HeaderRoom), make([]byte, 64<<10)
	for q := range queues {
		for i := range 5 {
			var f Frame
			var err error
			if i%2 == 0 {
				f, err = p.Take(q, buf)
			} else {
				f, err = p.Free(q, hdr)
			}
			if err != nil {
				t.Fatalf("queue %d, frame %d: %v", q, i, err)
			}
			if f.Seq != uint32(q<<16|i) || f.Conn.Local != testSrc || f.Conn.Remote != testDst {
				t.Fatalf("queue %d gave %v seq %#x as its frame %d, want seq %#x", q, f.Conn, f.Seq, i, q<<16|i)
			}
			if i%2 == 0 && !bytes.Equal(f.Payload, payload(q, i)) {
				t.Fatalf("queue %d, frame %d: payload differs (%d bytes)", q, i, len(f.Payload))
			}
		}
		if _, err := p.Free(q, hdr); !errors.Is(err, ErrEmpty) {
			t.Fatalf("queue %d after its frames: %v, want ErrEmpty", q, err)
		}
	}
	// A full queue refuses the next frame at once.
	err := sendTo(0, qlen+1)
	if !errors.Is(err, unix.ENOBUFS) {
		t.Fatalf("sending %d frames into a queue of %d: %v, want ENOBUFS for the last", qlen+1, qlen, err)
	}
	for i := range qlen {
		if f, err := p.Free(0, hdr); err != nil || f.Seq != uint32(i) {
			t.Fatalf("full queue, frame %d: seq %d, %v", i, f.Seq, err)
		}
	}
	// A clone larger than Take's buffer is an error, not a silently short payload.
	if err := sendTo(1, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Take(1, buf[:200]); err == nil {
		t.Fatal("Take into a buffer shorter than the frame succeeded")
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Do("node1", func() error {
		_, err := netlink.LinkByName("ftparktest0")
		if err == nil {
			return errors.New("the park's device outlived Close")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// TestBucket: the buckets of destination addresses, which park_bucket in bpf/tcplog.c computes the same
// way (the capture's tests check that the two agree on the records of real flows).
func TestBucket(t *testing.T) {
	for _, tt := range []struct {
		addr    string
		buckets int
		want    int
	}{
		{"10.77.0.2", 8, 5}, // 10^77^0^2 = 69
		{"10.77.0.3", 8, 4}, // 68
		{"10.77.0.3", 1, 0},
		{"10.77.0.3", 0, 0},
		{"192.168.255.1", 256, 150},
		{"::1", 8, 0},
		// A dual-stack socket's view of the same destination: its clones are in 10.77.0.2's bucket.
		{"::ffff:10.77.0.2", 8, 5},
	} {
		if got := Bucket(netip.MustParseAddr(tt.addr), tt.buckets); got != tt.want {
			t.Errorf("Bucket(%s, %d) = %d, want %d", tt.addr, tt.buckets, got, tt.want)
		}
	}
}

// TestParkOpensMaxQueues: the largest park a capture opens, MaxQueues queues of 8192 slots (a host of 32
// CPUs or more, netlog/capture's parkQueueLen), opens and reaches its last queue by mark.
func TestParkOpensMaxQueues(t *testing.T) {
	p, sock := openTestPark(t, labtest.New(t, 1, 0), "ftparktest1", MaxQueues, 8192)
	if err := sendMarked(sock, p, MaxQueues-1, 7, []byte("last queue")); err != nil {
		t.Fatal(err)
	}
	if f, err := p.Free(MaxQueues-1, make([]byte, HeaderRoom)); err != nil || f.Seq != 7 {
		t.Fatalf("the last queue gave seq %d, %v; want the frame marked for it", f.Seq, err)
	}
}

// The flow of the tests' frames.
var testSrc, testDst = netip.MustParseAddrPort("10.9.0.1:40000"), netip.MustParseAddrPort("10.9.0.2:5201")

// openTestPark opens park name with queues queues of qlen slots on l's node1, and a packet socket there to
// send frames out of it; both are closed when the test ends.
func openTestPark(t *testing.T, l *lab.Lab, name string, queues, qlen int) (*Park, int) {
	t.Helper()
	var p *Park
	var sock int
	err := l.Do("node1", func() error {
		var err error
		if p, err = Open(name, queues, qlen); err != nil {
			return err
		}
		t.Cleanup(func() { p.Close() })
		if sock, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0); err != nil {
			return err
		}
		t.Cleanup(func() { unix.Close(sock) })
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if p.Queues() != queues {
		t.Fatalf("%d queues, want %d", p.Queues(), queues)
	}
	return p, sock
}

// sendMarked sends a frame of the tests' flow with seq and payload out of p, marked mark (the socket's
// mark is the frame's), as the log's program marks each clone with its queue.
func sendMarked(sock int, p *Park, mark int, seq uint32, payload []byte) error {
	if err := unix.SetsockoptInt(sock, unix.SOL_SOCKET, unix.SO_MARK, mark); err != nil {
		return err
	}
	to := &unix.SockaddrLinklayer{Ifindex: p.Ifindex(), Protocol: 0x0008} // ETH_P_IP, network order
	return unix.Sendto(sock, frame(testSrc, testDst, seq, payload, false, 0, 0), 0, to)
}
