//go:build linux

package park

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/lab/labtest"
)

// TestParkQueuesByCPU sends frames out of the park from threads pinned to each CPU, as the log's program
// clones segments on the CPU that sends them, and checks what the design rests on: each CPU's frames wait
// in its own queue, in the order sent; Free and Take give them back, headers or whole; a full queue
// refuses a frame at once (with no qdisc the sender learns it, so the program can copy the segment
// instead); an empty one says so; Close removes the device.
func TestParkQueuesByCPU(t *testing.T) {
	l := labtest.New(t, 1, 0)
	cpus := min(runtime.NumCPU(), 4)
	const qlen = 8
	var p *Park
	var sock int
	err := l.Do("node1", func() error {
		var err error
		if p, err = Open("ftparktest0", cpus, qlen); err != nil {
			return err
		}
		if _, err := Open("ftparktest0", 1, 1); err == nil {
			return errors.New("a second park of the same name opened")
		}
		sock, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sock)
	defer p.Close()
	if p.Queues() != cpus {
		t.Fatalf("%d queues, want %d", p.Queues(), cpus)
	}
	to := &unix.SockaddrLinklayer{Ifindex: p.Ifindex(), Protocol: 0x0008} // ETH_P_IP, network order
	src, dst := netip.MustParseAddrPort("10.9.0.1:40000"), netip.MustParseAddrPort("10.9.0.2:5201")
	payload := func(cpu, i int) []byte { return bytes.Repeat([]byte(fmt.Sprintf("cpu %d frame %d;", cpu, i)), 100) }
	// sendOn sends frames i = 0..n-1 from a thread pinned to cpu; it returns the first error.
	sendOn := func(cpu, n int) error {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var old, one unix.CPUSet
		if err := unix.SchedGetaffinity(0, &old); err != nil {
			return err
		}
		defer unix.SchedSetaffinity(0, &old)
		one.Set(cpu)
		if err := unix.SchedSetaffinity(0, &one); err != nil {
			return err
		}
		for i := range n {
			if err := unix.Sendto(sock, frame(src, dst, uint32(cpu<<16|i), payload(cpu, i), false, 0, 0), 0, to); err != nil {
				return fmt.Errorf("frame %d from CPU %d: %w", i, cpu, err)
			}
		}
		return nil
	}
	for cpu := range cpus {
		if err := sendOn(cpu, 5); err != nil {
			t.Fatal(err)
		}
	}
	hdr, buf := make([]byte, HeaderRoom), make([]byte, 64<<10)
	for cpu := range cpus {
		for i := range 5 {
			var f Frame
			var err error
			if i%2 == 0 {
				f, err = p.Take(cpu, buf)
			} else {
				f, err = p.Free(cpu, hdr)
			}
			if err != nil {
				t.Fatalf("queue %d, frame %d: %v", cpu, i, err)
			}
			if f.Seq != uint32(cpu<<16|i) || f.Conn.Local != src || f.Conn.Remote != dst {
				t.Fatalf("queue %d gave %v seq %#x as its frame %d, want seq %#x", cpu, f.Conn, f.Seq, i, cpu<<16|i)
			}
			if i%2 == 0 && !bytes.Equal(f.Payload, payload(cpu, i)) {
				t.Fatalf("queue %d, frame %d: payload differs (%d bytes)", cpu, i, len(f.Payload))
			}
		}
		if _, err := p.Free(cpu, hdr); !errors.Is(err, ErrEmpty) {
			t.Fatalf("queue %d after its frames: %v, want ErrEmpty", cpu, err)
		}
	}
	// A full queue refuses the next frame at once.
	err = sendOn(0, qlen+1)
	if !errors.Is(err, unix.ENOBUFS) {
		t.Fatalf("sending %d frames into a queue of %d: %v, want ENOBUFS for the last", qlen+1, qlen, err)
	}
	for i := range qlen {
		if f, err := p.Free(0, hdr); err != nil || f.Seq != uint32(i) {
			t.Fatalf("full queue, frame %d: seq %d, %v", i, f.Seq, err)
		}
	}
	// A clone larger than Take's buffer is an error, not a silently short payload.
	if err := sendOn(1%cpus, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Take(1%cpus, buf[:200]); err == nil {
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
