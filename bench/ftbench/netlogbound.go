package main

import (
	"errors"
	"fmt"
	"io"
	"runtime"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/coldcopy"
	"github.com/ftkit/ftkit/netlog/capture"
)

// The copy bound. Issue 13 asks for 0.80 of the unshaped throughput with the sender-side log, or a measured
// bound showing that no design reaches it on this machine. A design either copies each byte the job sends
// at least once (the kernel frees a segment's pages once it is acknowledged, and the job, unmodified,
// cannot hand its buffers over), or keeps clones of the segments in the kernel (modePark, below). For the
// first kind the bench runs the transfer with exactly that one copy and nothing else, at the two best
// places a design could put it, both more favourable than any real one: in the sending thread right after
// each write, from the buffer the kernel has just read (in that CPU's cache; a probe on the sender's path
// copies from the segment instead, after walking it), and on a thread of its own beside the sender, woken
// once per 8 MiB sent as the log's consumer is, copying from that same buffer rather than from a ring the
// probe wrote. Both copy into 256 MiB of memory faulted in beforehand (a warm log's pool) with the log's own
// non-temporal copy. The better of the two throughputs bounds every design that copies.

// copyBatch is how much the beside copier is handed at a time: an eighth of the log's 64 MiB ring, when
// the logger's program wakes its consumer (feedBatch).
const copyBatch = feedBatch

// shadowCopy is the bulk sender's one copy of what it sends (FTBENCH_COPY): none, "sender" (in the
// sending thread after each write) or "beside" (a thread of its own, copyBatch bytes at a time).
type shadowCopy struct {
	data    []byte // the sender's buffer, whose bytes are sent round and round
	dst     []byte
	at      int // next offset in dst
	pending int // bytes sent and not yet handed to the beside copier
	inline  bool
	batches chan int // beside: byte counts to copy; its capacity bounds the lag to the ring's 64 MiB
	done    chan shadowResult
	copied  int64
}

type shadowResult struct {
	copied int64
	cpu    time.Duration
	err    error
}

func newShadowCopy(mode string, data []byte) (*shadowCopy, error) {
	s := &shadowCopy{data: data}
	switch mode {
	case "":
		return s, nil
	case "sender":
		s.inline = true
	case "beside":
		s.batches, s.done = make(chan int, (64<<20)/copyBatch), make(chan shadowResult, 1)
	default:
		return nil, fmt.Errorf("FTBENCH_COPY %q: want sender or beside", mode)
	}
	s.dst = make([]byte, 256<<20)
	for i := 0; i < len(s.dst); i += 4096 {
		s.dst[i] = 1 // faulted in before the transfer, as a warm log's pool is
	}
	if s.batches != nil {
		go s.beside()
	}
	return s, nil
}

// sent is called after each write of data[off:off+n].
func (s *shadowCopy) sent(off, n int) {
	switch {
	case s.inline:
		s.copyOut(off, n)
	case s.batches != nil:
		s.pending += n
		if s.pending >= copyBatch {
			s.batches <- s.pending
			s.pending = 0
		}
	}
}

// copyOut copies n bytes of data from off, wrapping, into dst in pieces of at most 64 KiB.
func (s *shadowCopy) copyOut(off, n int) {
	for n > 0 {
		if off >= len(s.data) {
			off = 0
		}
		if s.at >= len(s.dst) {
			s.at = 0
		}
		k := coldcopy.Copy(s.dst[s.at:], s.data[off:min(off+n, off+64<<10, len(s.data))])
		s.at += k
		off += k
		n -= k
		s.copied += int64(k)
	}
}

// beside is the copier thread: its CPU time is the thread's clock.
func (s *shadowCopy) beside() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	start, err := threadCPUSeconds()
	off := 0
	for n := range s.batches {
		s.copyOut(off, n)
		off = (off + n) % len(s.data)
	}
	end, err2 := threadCPUSeconds()
	if err == nil {
		err = err2
	}
	s.done <- shadowResult{copied: s.copied, cpu: time.Duration((end - start) * 1e9), err: err}
}

// finish hands the beside copier what is left, waits for it, and returns how many bytes were copied and,
// beside, the copier thread's CPU time (0 when the copy ran in the sender).
func (s *shadowCopy) finish() (int64, time.Duration, error) {
	if s.batches == nil {
		return s.copied, 0, nil
	}
	if s.pending > 0 {
		s.batches <- s.pending
	}
	close(s.batches)
	r := <-s.done
	return r.copied, r.cpu, r.err
}

// The other kind of design copies nothing: the probe clones each segment to a tap device
// (bpf_clone_redirect: the clone shares the segment's pages) and the clones wait in the tap's queue, which
// is the log, until a receiver's snapshot lets them go, when a read of the clone's headers, which tell its
// flow and place, frees it. Its ceiling is measured too (modePark): the clones of every segment the sender
// sends, freed every poll interval by such reads. Not built as a log: see docs/design.md.

// parkTap is the tap device the park mode's clones wait in, in node1's network namespace.
const parkTap = "ftpark0"

// parkQueue is the tap's queue length in packets: more segments than the sender sends in a poll interval.
const parkQueue = 1 << 16

// parkRun is the park mode on node1: the program, its link, the tap, and the thread that frees the clones.
type parkRun struct {
	prog  *ebpf.Program
	link  link.Link
	stats io.Closer
	fd    int // the tap's queue, non-blocking, never in the runtime's poller (its readiness would wake it)
	stop  chan struct{}
	done  chan parkResult
}

type parkResult struct {
	packets int64
	payload int64 // TCP payload bytes the clones' headers announce
	cpu     time.Duration
	err     error
}

// parkClones sets the park mode up on node1 for the sender's cgroup.
func (b *netlogBench) parkClones() (p *parkRun, err error) {
	p = &parkRun{fd: -1, stop: make(chan struct{}), done: make(chan parkResult, 1)}
	defer func() {
		if err != nil {
			p.release()
		}
	}()
	err = b.lab.Do("node1", func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		p.fd = fd
		ifr, err := unix.NewIfreq(parkTap)
		if err != nil {
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			return fmt.Errorf("create tap %s: %w", parkTap, err)
		}
		// Offloads, as the veth has: without them the kernel would cut each clone into segments and sum
		// them, work the log's design would not have to do.
		if err := unix.IoctlSetInt(fd, unix.TUNSETOFFLOAD, unix.TUN_F_CSUM|unix.TUN_F_TSO4|unix.TUN_F_TSO6); err != nil {
			return fmt.Errorf("offloads of %s: %w", parkTap, err)
		}
		tap, err := netlink.LinkByName(parkTap)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetTxQLen(tap, parkQueue); err != nil {
			return fmt.Errorf("queue length of %s: %w", parkTap, err)
		}
		if err := netlink.LinkSetUp(tap); err != nil { // a down device drops what is sent to it
			return fmt.Errorf("set %s up: %w", parkTap, err)
		}
		eth0, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		p.prog, err = ebpf.NewProgram(&ebpf.ProgramSpec{
			Type:    ebpf.SchedCLS,
			License: "Dual BSD/GPL",
			Instructions: asm.Instructions{
				asm.Mov.Reg(asm.R6, asm.R1),
				asm.FnSkbCgroupId.Call(),
				asm.LoadImm(asm.R1, int64(b.sendCg.ID), asm.DWord),
				asm.JNE.Reg(asm.R0, asm.R1, "pass"),
				asm.Mov.Reg(asm.R1, asm.R6),
				asm.Mov.Imm(asm.R2, int32(tap.Attrs().Index)),
				asm.Mov.Imm(asm.R3, 0), // egress of the tap: into its queue
				asm.FnCloneRedirect.Call(),
				asm.Mov.Imm(asm.R0, 0).WithSymbol("pass"), // TCX_PASS: the segment goes on as it would
				asm.Return(),
			},
		})
		if err != nil {
			return fmt.Errorf("load the park program: %w", err)
		}
		p.link, err = link.AttachTCX(link.TCXOptions{Interface: eth0.Attrs().Index, Program: p.prog, Attach: ebpf.AttachTCXEgress})
		if err != nil {
			return fmt.Errorf("attach the park program to node1 eth0: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if p.stats, err = ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME)); err != nil {
		return nil, fmt.Errorf("enable BPF run time statistics: %w", err)
	}
	go p.free()
	return p, nil
}

// free is the thread that lets the clones go every poll interval, until stop, and then once more. It reads
// each clone's headers only, which is what a log would learn a segment's flow and place from, and counts
// the TCP payload they announce.
func (p *parkRun) free() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	start, err := threadCPUSeconds()
	var packets, payload int64
	var buf [128]byte // Ethernet, IPv4 and TCP headers with options
	for stopping := false; err == nil; {
		for {
			n, rerr := unix.Read(p.fd, buf[:])
			if rerr == unix.EAGAIN {
				break
			}
			if rerr != nil && rerr != unix.EINTR {
				err = fmt.Errorf("read %s: %w", parkTap, rerr)
				break
			}
			packets++
			payload += tcpPayload(buf[:max(n, 0)])
		}
		if stopping {
			break
		}
		select {
		case <-p.stop:
			stopping = true
		case <-time.After(capture.DefaultPollInterval):
		}
	}
	end, cerr := threadCPUSeconds()
	if err == nil {
		err = cerr
	}
	p.done <- parkResult{packets: packets, payload: payload, cpu: time.Duration((end - start) * 1e9), err: err}
}

// tcpPayload returns the TCP payload length an Ethernet frame's IPv4 and TCP headers announce (the whole
// segment's, for a clone of a GSO segment), or 0 for any other frame.
func tcpPayload(f []byte) int64 {
	const eth = 14
	if len(f) < eth+20 || f[12] != 0x08 || f[13] != 0x00 || f[eth]>>4 != 4 || f[eth+9] != unix.IPPROTO_TCP {
		return 0
	}
	ihl := int(f[eth]&0x0f) * 4
	total := int(f[eth+2])<<8 | int(f[eth+3])
	if ihl < 20 || len(f) < eth+ihl+13 {
		return 0
	}
	doff := int(f[eth+ihl+12]>>4) * 4
	return int64(max(total-ihl-doff, 0))
}

// close stops the thread once every clone is freed and checks that the clones held every byte of the
// total sent, the tap dropping none (a drop would have spared the sender work a log must do); it returns the program's and
// the freeing thread's CPU time, and frees everything.
func (p *parkRun) close(b *netlogBench, total int64) (prog, freeing time.Duration, err error) {
	var st *ebpf.ProgramStats
	if st, err = p.prog.Stats(); err != nil {
		err = fmt.Errorf("park program statistics: %w", err)
	}
	close(p.stop)
	r := <-p.done
	err = errors.Join(err, r.err)
	lerr := b.lab.Do("node1", func() error {
		tap, err := netlink.LinkByName(parkTap)
		if err != nil {
			return err
		}
		s := tap.Attrs().Statistics
		if s == nil {
			return fmt.Errorf("tap %s has no statistics", parkTap)
		}
		if r.payload < total || s.TxDropped != 0 {
			return fmt.Errorf("tap %s held %d bytes of TCP payload in %d clones, of the %d sent, and dropped %d: the park mode's ceiling is not measured",
				parkTap, r.payload, r.packets, total, s.TxDropped)
		}
		return nil
	})
	err = errors.Join(err, lerr)
	p.release()
	if st != nil {
		prog = st.Runtime
	}
	return prog, r.cpu, err
}

// release detaches and closes what parkClones made; the tap goes with its last descriptor.
func (p *parkRun) release() {
	if p.link != nil {
		p.link.Close()
	}
	if p.prog != nil {
		p.prog.Close()
	}
	if p.stats != nil {
		p.stats.Close()
	}
	if p.fd >= 0 {
		unix.Close(p.fd)
	}
}
