//go:build linux

// Package park keeps clones of logged TCP segments in the kernel instead of copies in the log: a tap
// device whose queues hold the clones the sender-side log's program makes (bpf_clone_redirect: a clone
// shares the segment's pages, so nothing is copied while the job sends). The program picks a queue per
// sending CPU and bucket of destination addresses (Bucket) and marks the clone with it; a steering
// program puts each clone in the queue its mark names. One CPU fills a queue, so a queue gives its
// clones back in the order that CPU's records reached the log's ring: the log knows which clone comes
// next in each queue, and reads either its headers only, which frees it, once no recovery can need its
// bytes, or all of it, into the log, when a recovery needs them (only the queues of their destination's
// bucket) or the park is full. See docs/design.md.
package park

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// MaxQueues is the most queues a tap device has (the kernel's MAX_TAP_QUEUES).
const MaxQueues = 256

// HeaderRoom is what a frame holds besides its TCP payload, at most: Ethernet with a VLAN tag, and IPv4
// and TCP headers with their options. A Take buffer must hold the payload and this.
const HeaderRoom = 14 + 4 + 60 + 60

// skbMarkOffset is the offset of mark in struct __sk_buff (after len and pkt_type).
const skbMarkOffset = 8

// MaxBuckets is the most buckets of destination addresses the log's program can tell apart (Bucket).
const MaxBuckets = 256

// Bucket is the bucket of destination address dst among buckets (a power of 2 up to MaxBuckets): the
// XOR of its four bytes, modulo buckets. It must agree with park_bucket in bpf/tcplog.c, which picks
// the queue of each clone; an address that is not IPv4 is in bucket 0 (the program parks IPv4 only). An
// IPv4-mapped IPv6 address is its IPv4 address: a dual-stack socket's tuple (in CRIU's images, a peer's
// range request) names the same destination as the program's IPv4 headers.
func Bucket(dst netip.Addr, buckets int) int {
	dst = dst.Unmap()
	if !dst.Is4() || buckets <= 1 {
		return 0
	}
	a := dst.As4()
	return int(a[0]^a[1]^a[2]^a[3]) & (buckets - 1)
}

// ErrEmpty is returned by Free and Take when the queue holds no clone.
var ErrEmpty = errors.New("park: queue empty")

// Park is an open park: the tap device, a descriptor per queue, and the steering program.
type Park struct {
	name    string
	ifindex int
	fds     []int
	steer   *ebpf.Program
}

// Open creates the park as tap device name, with queues queues of queueLen clones each, in the calling
// thread's network namespace, and sets it up: offloads as a veth has (a clone of a GSO segment stays
// one frame), no qdisc (a full queue fails the program's clone at once, which then copies the segment
// instead), no IPv6 and no ARP (nothing but clones enters it), up. It refuses a name in use. The device
// goes with Close, or with the process.
func Open(name string, queues, queueLen int) (p *Park, err error) {
	if queues < 1 || queues > MaxQueues {
		return nil, fmt.Errorf("park %s: %d queues: want 1..%d", name, queues, MaxQueues)
	}
	if queueLen < 1 {
		return nil, fmt.Errorf("park %s: queue length %d: want at least 1", name, queueLen)
	}
	if _, err := netlink.LinkByName(name); err == nil {
		return nil, fmt.Errorf("park %s: a device of that name exists in this network namespace (another agent's park?): remove it or name another", name)
	}
	p = &Park{name: name}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	for range queues {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("park %s: open /dev/net/tun: %w", name, err)
		}
		p.fds = append(p.fds, fd)
		ifr, err := unix.NewIfreq(name)
		if err != nil {
			return nil, fmt.Errorf("park %s: %w", name, err)
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_MULTI_QUEUE)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			return nil, fmt.Errorf("park %s: attach queue %d: %w", name, len(p.fds)-1, err)
		}
	}
	if err := unix.IoctlSetInt(p.fds[0], unix.TUNSETOFFLOAD, unix.TUN_F_CSUM|unix.TUN_F_TSO4|unix.TUN_F_TSO6); err != nil {
		return nil, fmt.Errorf("park %s: offloads: %w", name, err)
	}
	// The queue is the frame's mark (modulo the queues), which the log's program sets on each clone: the
	// program knows the sending CPU and the destination's bucket, and anything else sent out of the park
	// (unmarked) goes to queue 0.
	p.steer, err = ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:    ebpf.SocketFilter,
		License: "Dual BSD/GPL",
		Instructions: asm.Instructions{
			asm.LoadMem(asm.R0, asm.R1, skbMarkOffset, asm.Word),
			asm.Return(),
		},
	})
	if err != nil {
		return nil, fmt.Errorf("park %s: load the steering program: %w", name, err)
	}
	if err := unix.IoctlSetPointerInt(p.fds[0], unix.TUNSETSTEERINGEBPF, p.steer.FD()); err != nil {
		return nil, fmt.Errorf("park %s: attach the steering program: %w", name, err)
	}
	lk, err := netlink.LinkByName(name)
	if err != nil {
		return nil, fmt.Errorf("park %s: %w", name, err)
	}
	p.ifindex = lk.Attrs().Index
	if err := disableIPv6(name); err != nil {
		return nil, err
	}
	if err := netlink.LinkSetARPOff(lk); err != nil {
		return nil, fmt.Errorf("park %s: ARP off: %w", name, err)
	}
	if err := netlink.LinkSetTxQLen(lk, queueLen); err != nil {
		return nil, fmt.Errorf("park %s: queue length %d: %w", name, queueLen, err)
	}
	noqueue := &netlink.GenericQdisc{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: p.ifindex, Parent: netlink.HANDLE_ROOT},
		QdiscType:  "noqueue",
	}
	if err := netlink.QdiscReplace(noqueue); err != nil {
		return nil, fmt.Errorf("park %s: replace its qdisc with noqueue: %w", name, err)
	}
	if err := netlink.LinkSetUp(lk); err != nil { // a device that is down drops what is sent to it
		return nil, fmt.Errorf("park %s: set up: %w", name, err)
	}
	return p, nil
}

// disableIPv6 keeps the kernel from sending anything of its own (router solicitations, MLD reports)
// into the park, whose queues must hold clones only. A kernel without IPv6 has nothing to disable.
func disableIPv6(name string) error {
	path := filepath.Join("/proc/sys/net/ipv6/conf", name, "disable_ipv6")
	if err := os.WriteFile(path, []byte("1"), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("park %s: disable IPv6: %w", name, err)
	}
	return nil
}

// Name is the tap device's name.
func (p *Park) Name() string { return p.name }

// Ifindex is the tap device's interface index, which the log's program clones into.
func (p *Park) Ifindex() int { return p.ifindex }

// Queues is how many queues the park has: the program parks only segments whose queue is below it.
func (p *Park) Queues() int { return len(p.fds) }

// Free reads the headers of queue q's next clone, which frees it, and returns them (Frame.Payload holds
// what of the payload fits in hdr after them, if anything). hdr needs HeaderRoom bytes.
func (p *Park) Free(q int, hdr []byte) (Frame, error) {
	n, err := p.read(q, hdr)
	if err != nil {
		return Frame{}, err
	}
	return ParseFrame(hdr[:n], false)
}

// Take reads queue q's next clone whole into buf and returns it; Payload aliases buf. A clone larger
// than buf is an error (its bytes are lost): size buf for the longest payload the program parks, plus
// HeaderRoom.
func (p *Park) Take(q int, buf []byte) (Frame, error) {
	n, err := p.read(q, buf)
	if err != nil {
		return Frame{}, err
	}
	if n == len(buf) {
		return Frame{}, fmt.Errorf("park %s: a clone of queue %d fills the %d-byte buffer: it may be cut short", p.name, q, len(buf))
	}
	return ParseFrame(buf[:n], true)
}

func (p *Park) read(q int, buf []byte) (int, error) {
	if q < 0 || q >= len(p.fds) {
		return 0, fmt.Errorf("park %s: no queue %d", p.name, q)
	}
	for {
		n, err := unix.Read(p.fds[q], buf)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return 0, ErrEmpty
		case err != nil:
			return 0, fmt.Errorf("park %s: read queue %d: %w", p.name, q, err)
		}
		return n, nil
	}
}

// Close removes the park: the device goes with its last queue's descriptor, and the clones with it.
func (p *Park) Close() error {
	var errs []error
	for _, fd := range p.fds {
		if err := unix.Close(fd); err != nil {
			errs = append(errs, err)
		}
	}
	p.fds = nil
	if p.steer != nil {
		errs = append(errs, p.steer.Close())
		p.steer = nil
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("park %s: close: %w", p.name, err)
	}
	return nil
}
