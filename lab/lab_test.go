package lab_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/lab/slurm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// roundTrip writes one line on conn and checks that the echo server returns it.
func roundTrip(t *testing.T, conn net.Conn, msg string) {
	t.Helper()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintln(conn, msg); err != nil {
		t.Fatalf("write %q: %v", msg, err)
	}
	got, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || strings.TrimSpace(got) != msg {
		t.Fatalf("echo of %q = %q, %v", msg, got, err)
	}
}

func TestLabCrossHostAndCrash(t *testing.T) {
	l := labtest.New(t, 3, 1)
	st := l.State()
	n3, _ := l.Host("node3")

	// Sockets are bound to the namespace they are created in, so the listener and the client socket
	// live in node3 and node1 while this test's goroutines use them from any thread.
	var ln net.Listener
	if err := l.Do("node3", func() (err error) {
		ln, err = net.Listen("tcp", n3.Addr.Addr().String()+":7000")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); bufio.NewReader(c).WriteTo(c) }()
		}
	}()
	var conn net.Conn
	if err := l.Do("node1", func() (err error) {
		conn, err = net.DialTimeout("tcp", n3.Addr.Addr().String()+":7000", 5*time.Second)
		return err
	}); err != nil {
		t.Fatalf("node1 -> node3: %v", err)
	}
	defer conn.Close()
	roundTrip(t, conn, "before crash")

	if err := l.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(lab.NetnsPath(st.Hosts[1].Namespace)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("node2's namespace still exists after crash: %v", err)
	}
	if _, err := netlink.LinkByName(st.Hosts[1].Veth); err == nil {
		t.Errorf("node2's veth %s still exists after crash", st.Hosts[1].Veth)
	}
	if err := l.Crash(context.Background(), "node2"); err == nil {
		t.Error("crashing node2 twice succeeded")
	}
	roundTrip(t, conn, "after crash")

	s := l.Status()
	for _, h := range s.Hosts {
		if wantExists := h.Name != "node2"; h.Exists != wantExists || h.Crashed == wantExists {
			t.Errorf("status of %s: exists=%v crashed=%v", h.Name, h.Exists, h.Crashed)
		}
		if h.Exists && (!h.LinkUp || len(h.Addrs) != 1 || h.Addrs[0] != h.Addr) {
			t.Errorf("status of %s: link up %v addrs %v, want %s", h.Name, h.LinkUp, h.Addrs, h.Addr)
		}
	}
}

func TestLabRefusesDuplicates(t *testing.T) {
	l := labtest.New(t, 1, 0)
	st := l.State()
	_, err := lab.Up(context.Background(), lab.Config{ID: st.ID, Nodes: 1, Subnet: st.Subnet}, lab.Options{})
	if !errors.Is(err, lab.ErrExists) {
		t.Fatalf("second lab with the same id: %v, want ErrExists", err)
	}
	_, err = lab.Up(context.Background(), lab.Config{ID: "x" + st.ID[1:], Nodes: 1, Subnet: st.Subnet}, lab.Options{})
	if !errors.Is(err, lab.ErrSubnetInUse) {
		t.Fatalf("second lab on the same subnet: %v, want ErrSubnetInUse", err)
	}
}

func TestLabDownRemovesEverything(t *testing.T) {
	labtest.RequireRoot(t)
	ctx := context.Background()
	// Its own id and subnet, as labtest.New draws them: two runs of this package at once must not share a lab.
	id := fmt.Sprintf("d%06x", rand.Uint32()&0xffffff)
	l, err := lab.Up(ctx, lab.Config{ID: id, Nodes: 2, Spares: 1, Subnet: lab.RandomTestSubnet()}, lab.Options{StateDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	st := l.State()
	t.Cleanup(func() {
		if err := l.Down(ctx); err != nil {
			t.Errorf("lab down: %v", err)
		}
	})
	// A process left running inside a host must not keep anything alive.
	if err := l.Do("node1", func() error { return startSleeper(t) }); err != nil {
		t.Fatal(err)
	}
	// Nor must mounts left in a cleanup directory, as a CRIU killed mid-restore leaves its cgroup yard
	// (the lab's state once could not be removed after that).
	yard := filepath.Join(t.TempDir(), "restore", "job", ".criu.cgyard")
	if err := os.MkdirAll(filepath.Join(yard, "inner"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := l.AddCleanup(filepath.Dir(filepath.Dir(yard))); err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{yard, filepath.Join(yard, "inner")} {
		if err := os.MkdirAll(m, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("none", m, "tmpfs", 0, ""); err != nil {
			t.Fatalf("mount tmpfs on %s: %v", m, err)
		}
		t.Cleanup(func() { unix.Unmount(m, unix.MNT_DETACH) })
		if err := os.WriteFile(filepath.Join(m, "cgroup.procs"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Down(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(yard); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cleanup directory with mounts in it left behind: %v", err)
	}
	if err := l.Down(ctx); err != nil {
		t.Fatalf("second down: %v", err)
	}
	if st.Router.Namespace == "" {
		t.Fatal("the lab has no router")
	}
	for _, h := range append(st.Hosts, st.Router) {
		if _, err := os.Stat(lab.NetnsPath(h.Namespace)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("namespace %s left behind", h.Namespace)
		}
		if _, err := netlink.LinkByName(h.Veth); err == nil {
			t.Errorf("veth %s left behind", h.Veth)
		}
	}
	if _, err := netlink.LinkByName(st.Bridge); err == nil {
		t.Errorf("bridge %s left behind", st.Bridge)
	}
}

// TestRouterRefusesTrafficBeyondTheLab: a host that routes through the lab's router (as job networks do)
// gets an immediate refusal for any address outside the lab, and nothing leaves the lab. Before the router
// existed, the gateway was an address nobody held: a DNS lookup in a job network waited 18 s for its
// timeouts, and `ftctl mpirun --job-addresses` took 50 s to start `hostname` on three hosts.
func TestRouterRefusesTrafficBeyondTheLab(t *testing.T) {
	l := labtest.New(t, 1, 0)
	st := l.State()
	gw := st.Router.Addr.Addr()
	if want := st.Subnet.Masked().Addr().Next(); gw != want {
		t.Fatalf("router at %v, want the subnet's first address %v", gw, want)
	}
	err := l.Do("node1", func() error {
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: eth0.Attrs().Index, Gw: gw.AsSlice()}); err != nil {
			return fmt.Errorf("default route via %v: %w", gw, err)
		}
		// TEST-NET-1 addresses (RFC 5737): outside every lab, answered by the router itself.
		start := time.Now()
		if c, err := net.DialTimeout("tcp4", "192.0.2.1:80", 10*time.Second); !errors.Is(err, unix.ECONNREFUSED) {
			if c != nil {
				c.Close()
			}
			return fmt.Errorf("TCP connect beyond the lab: %v after %s, want connection refused", err, time.Since(start))
		}
		for i := range 20 { // a burst of lookups, as mpirun makes: no rate limit may turn one into a timeout
			c, err := net.Dial("udp4", "192.0.2.53:53")
			if err != nil {
				return err
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			start := time.Now()
			_, err = c.Write([]byte("query"))
			if err == nil {
				_, err = c.Read(make([]byte, 512))
			}
			c.Close()
			if !errors.Is(err, unix.ECONNREFUSED) {
				return fmt.Errorf("UDP datagram %d beyond the lab: %v after %s, want connection refused", i, err, time.Since(start))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// startSleeper starts a long sleep in the caller's network namespace; the lab must kill it.
func startSleeper(t *testing.T) error {
	cmd := exec.Command("sleep", "300")
	if err := cmd.Start(); err != nil {
		return err
	}
	go cmd.Wait() // reap it once the lab kills it
	return nil
}

// TestLabRevive: a crashed host comes back with its original address and answers on it; a host that is
// not crashed, or whose address another host holds (after an IP takeover), is not revived.
func TestLabRevive(t *testing.T) {
	l := labtest.New(t, 2, 1)
	ctx := context.Background()
	n2, _ := l.Host("node2")
	if err := l.Revive(ctx, "node2"); err == nil {
		t.Fatal("reviving a host that is up succeeded")
	}
	if err := l.Crash(ctx, "node2"); err != nil {
		t.Fatal(err)
	}

	// spare1 takes node2's address over, as fail-over does today: revive must refuse.
	addOnEth0 := func(add bool) {
		t.Helper()
		if err := l.Do("spare1", func() error {
			link, err := netlink.LinkByName("eth0")
			if err != nil {
				return err
			}
			a, _ := netlink.ParseAddr(n2.Addr.String())
			if add {
				return netlink.AddrAdd(link, a)
			}
			return netlink.AddrDel(link, a)
		}); err != nil {
			t.Fatal(err)
		}
	}
	addOnEth0(true)
	if err := l.Revive(ctx, "node2"); err == nil || !strings.Contains(err.Error(), "spare1") {
		t.Fatalf("revive while spare1 holds node2's address: %v, want a refusal naming spare1", err)
	}
	addOnEth0(false)

	if err := l.Revive(ctx, "node2"); err != nil {
		t.Fatal(err)
	}
	var ln net.Listener
	if err := l.Do("node2", func() (err error) {
		ln, err = net.Listen("tcp", n2.Addr.Addr().String()+":7000")
		return err
	}); err != nil {
		t.Fatalf("listen on node2's original address after revive: %v", err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			bufio.NewReader(c).WriteTo(c)
			c.Close()
		}
	}()
	var conn net.Conn
	if err := l.Do("node1", func() (err error) {
		conn, err = net.DialTimeout("tcp", n2.Addr.Addr().String()+":7000", 5*time.Second)
		return err
	}); err != nil {
		t.Fatalf("node1 -> revived node2: %v", err)
	}
	defer conn.Close()
	roundTrip(t, conn, "after revive")
	for _, h := range l.Status().Hosts {
		if h.Crashed || !h.Exists || !h.LinkUp || len(h.Addrs) != 1 || h.Addrs[0] != h.Addr {
			t.Errorf("status of %s after revive: %+v", h.Name, h)
		}
	}
}

// TestHostInterfaceIndex: a host's eth0 is made inside the host's namespace, so its interface index is the
// host's first after lo. Created in the root namespace and moved in, it kept the root's index, which grows
// with every lab; past 32767 Open MPI's PMIx matched no interface and every mpirun failed.
func TestHostInterfaceIndex(t *testing.T) {
	l := labtest.New(t, 2, 0)
	for _, h := range []string{"node1", "node2"} {
		if err := l.Do(h, func() error {
			eth0, err := net.InterfaceByName("eth0")
			if err != nil {
				return err
			}
			if eth0.Index != 2 {
				t.Errorf("%s's eth0 has interface index %d, want 2 (the host's first after lo)", h, eth0.Index)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCrashIsAtOnce: a crash ends a host's processes before anything else of it goes, as a power cut does.
// A process of the host that acts when the host's network goes (here it records each interface deleted,
// as ci130's crashing spare's agent, seeing its network gone, killed the job it had just restored and its
// shim recorded the exit) records nothing of the crash.
func TestCrashIsAtOnce(t *testing.T) {
	l := labtest.New(t, 1, 0)
	seen := filepath.Join(t.TempDir(), "deleted")
	script := fmt.Sprintf(`ip -o monitor link | while read -r line; do case "$line" in Deleted*) echo "$line" >> %s;; esac; done`, seen)
	cmd := exec.Command("bash", "-c", script)
	if err := l.Do("node1", cmd.Start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	// Ready once it reports a probe interface deleted.
	if err := l.Do("node1", func() error {
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if err := exec.Command("ip", "link", "add", "probe0", "type", "veth", "peer", "name", "probe1").Run(); err != nil {
				return fmt.Errorf("add a probe interface: %w", err)
			}
			if err := exec.Command("ip", "link", "del", "probe0").Run(); err != nil {
				return fmt.Errorf("delete the probe interface: %w", err)
			}
			if b, _ := os.ReadFile(seen); strings.Contains(string(b), "probe0") {
				return nil
			}
			if time.Now().After(deadline) {
				return errors.New("the link monitor saw no probe interface deleted")
			}
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := l.Crash(context.Background(), "node1"); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err == nil {
		t.Error("the monitor ended by itself; want it killed by the crash")
	}
	if b, _ := os.ReadFile(seen); strings.Contains(string(b), "eth0") {
		t.Errorf("a process of the crashed host acted on its network going:\n%s", b)
	}
}

// TestSweepOrphans: a lab whose owner exited (a test binary killed by its -timeout, its cleanups never run)
// is taken down by the next sweep, namespaces and all; a lab whose owner runs, one whose owner's PID now
// names another process, and one without an owner (the operator's) are handled as they should be.
func TestSweepOrphans(t *testing.T) {
	labtest.RequireRoot(t)
	ctx := context.Background()
	opts := lab.Options{StateDir: t.TempDir()} // the sweep sees only this test's labs
	self, err := lab.Self()
	if err != nil {
		t.Fatal(err)
	}
	exited := exec.Command("true")
	if err := exited.Start(); err != nil {
		t.Fatal(err)
	}
	dead, err := slurm.Identify("exited owner", "", exited.Process.Pid) // readable until reaped
	if err != nil {
		t.Fatal(err)
	}
	exited.Wait()
	reused := *self
	reused.Start++ // this PID, another start: the owner exited and its PID was given out again
	up := func(owner *slurm.Proc) lab.State {
		t.Helper()
		for {
			l, err := lab.Up(ctx, lab.Config{ID: fmt.Sprintf("s%06x", rand.Uint32()&0xffffff), Nodes: 1, Subnet: lab.RandomTestSubnet(), Owner: owner}, opts)
			if errors.Is(err, lab.ErrSubnetInUse) || errors.Is(err, lab.ErrExists) {
				continue
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := l.Down(ctx); err != nil {
					t.Errorf("lab down: %v", err)
				}
			})
			return l.State()
		}
	}
	orphan, reusedOrphan, live, unowned := up(&dead), up(&reused), up(self), up(nil)
	swept, err := lab.SweepOrphans(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{orphan.ID, reusedOrphan.ID}; !slices.Equal(slices.Sorted(slices.Values(swept)), slices.Sorted(slices.Values(want))) {
		t.Errorf("swept %v, want %v", swept, want)
	}
	labs, err := lab.List(opts)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, st := range labs {
		left = append(left, st.ID)
	}
	if want := []string{live.ID, unowned.ID}; !slices.Equal(left, slices.Sorted(slices.Values(want))) {
		t.Errorf("labs left %v, want %v", left, want)
	}
	for _, st := range []lab.State{orphan, reusedOrphan} {
		for _, h := range append(st.Hosts, st.Router) {
			if _, err := os.Stat(lab.NetnsPath(h.Namespace)); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("namespace %s of swept lab %s left behind", h.Namespace, st.ID)
			}
		}
	}
}
