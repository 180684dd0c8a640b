//go:build linux

package ebpfprobes

// Test fixtures: a two-host lab and the sendwait child role. The recv and
// send roles, cgroups and child processes are internal/streamtest's.

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
)

func TestMain(m *testing.M) {
	streamtest.ChildMain(map[string]func() error{"sendwait": sendWait, "sink": sink, "blast": blast, "serve": serve, "fetch": fetch, "recvparts": recvParts, "recvscript": recvScript, "pingpong": pingPong, "threadchurn": threadChurn}, 2*time.Minute)
	os.Exit(m.Run())
}

// sendWait is the sendwait child role: connect to FTKIT_ADDR, print "port
// <local port>", then for each size in the comma-separated FTKIT_SIZES send
// that many bytes of streamtest.Stream(FTKIT_SEED, total) in writes of varied
// sizes, print "sent <bytes so far>" and wait for a line on stdin; then close
// and print "closed".
func sendWait() error {
	addr := os.Getenv("FTKIT_ADDR")
	var seed uint64
	if _, err := fmt.Sscan(os.Getenv("FTKIT_SEED"), &seed); err != nil {
		return fmt.Errorf("parse FTKIT_SEED: %w", err)
	}
	var sizes []int
	total := 0
	for f := range strings.SplitSeq(os.Getenv("FTKIT_SIZES"), ",") {
		var n int
		if _, err := fmt.Sscan(f, &n); err != nil {
			return fmt.Errorf("parse FTKIT_SIZES: %w", err)
		}
		sizes = append(sizes, n)
		total += n
	}
	c, err := net.Dial("tcp4", addr)
	if err != nil {
		return err
	}
	fmt.Printf("port %d\n", c.LocalAddr().(*net.TCPAddr).Port)
	data := streamtest.Stream(seed, total)
	rnd := rand.New(rand.NewPCG(seed, 3))
	in := bufio.NewScanner(os.Stdin)
	off := 0
	for _, size := range sizes {
		for end := off + size; off < end; {
			n := min(rnd.IntN(1<<rnd.IntN(18))+1, end-off)
			if _, err := c.Write(data[off : off+n]); err != nil {
				return err
			}
			off += n
		}
		fmt.Printf("sent %d\n", off)
		if !in.Scan() {
			return fmt.Errorf("stdin closed before the go-ahead: %v", in.Err())
		}
	}
	if err := c.Close(); err != nil {
		return err
	}
	fmt.Println("closed")
	return nil
}

// testNet is a two-host lab: a (node1, the sender) and b (node2, the
// receiver), each with eth0 on the lab's bridge.
type testNet struct {
	lab      *lab.Lab
	ipA, ipB netip.Addr
}

const hostA, hostB = "node1", "node2"

func newTestNet(t *testing.T) *testNet {
	t.Helper()
	tn := &testNet{lab: labtest.New(t, 2, 0)}
	for _, h := range []struct {
		name string
		ip   *netip.Addr
	}{{hostA, &tn.ipA}, {hostB, &tn.ipB}} {
		host, err := tn.lab.Host(h.name)
		if err != nil {
			t.Fatal(err)
		}
		*h.ip = host.Addr.Addr()
	}
	return tn
}

// attach attaches l to host's eth0 egress.
func (tn *testNet) attach(l *TCPLogger, host string) error {
	return tn.lab.Do(host, func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return fmt.Errorf("find eth0 on %s: %w", host, err)
		}
		return l.Attach(eth0.Attrs().Index)
	})
}
