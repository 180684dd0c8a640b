//go:build linux

package ebpfprobes

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/streamtest"
	"github.com/ftkit/ftkit/internal/testenv"
	"github.com/ftkit/ftkit/tcpflow"
)

func TestNewTCPLoggerRejectsBadRingSize(t *testing.T) {
	for _, size := range []int{100, 3 << 20, os.Getpagesize() / 2, 1 << 32} {
		if l, err := NewTCPLogger(TCPLoggerOptions{RingBufferSize: size}); err == nil {
			l.Close()
			t.Errorf("ring size %d accepted", size)
		}
	}
}

func TestFlowKey(t *testing.T) {
	k, err := flowKey(tcpflow.Tuple{
		Local:  netip.MustParseAddrPort("10.250.7.1:40000"),
		Remote: netip.MustParseAddrPort("10.250.7.2:5001"),
	})
	if err != nil {
		t.Fatal(err)
	}
	// The key's memory must equal the raw header bytes the program copies.
	var b []byte
	b = binary.NativeEndian.AppendUint32(b, k.Saddr)
	b = binary.NativeEndian.AppendUint32(b, k.Daddr)
	b = binary.NativeEndian.AppendUint16(b, k.Sport)
	b = binary.NativeEndian.AppendUint16(b, k.Dport)
	want := []byte{10, 250, 7, 1, 10, 250, 7, 2, 0x9c, 0x40, 0x13, 0x89}
	if !bytes.Equal(b, want) {
		t.Errorf("flow key bytes %x, want %x", b, want)
	}
	if _, err := flowKey(tcpflow.Tuple{Local: netip.MustParseAddrPort("[::1]:1"), Remote: netip.MustParseAddrPort("[::1]:2")}); err == nil {
		t.Error("IPv6 flow accepted")
	}
}

// record is a parsed ring buffer record (payload copied).
type record struct {
	saddr, daddr netip.Addr
	sport, dport uint16
	seq          uint32
	cgroupID     uint64
	ktime        uint64
	payload      []byte
}

// parseRecord decodes the layout documented at RecordHeaderLen, independently
// of netlog so that this package's tests pin the layout themselves.
func parseRecord(raw []byte) (record, error) {
	if len(raw) < RecordHeaderLen {
		return record{}, fmt.Errorf("record of %d bytes is shorter than its header", len(raw))
	}
	n := binary.LittleEndian.Uint32(raw[16:20])
	if len(raw) != RecordHeaderLen+int(n) {
		return record{}, fmt.Errorf("record of %d bytes says payload %d", len(raw), n)
	}
	return record{
		saddr:    netip.AddrFrom4([4]byte(raw[0:4])),
		daddr:    netip.AddrFrom4([4]byte(raw[4:8])),
		sport:    binary.BigEndian.Uint16(raw[8:10]),
		dport:    binary.BigEndian.Uint16(raw[10:12]),
		seq:      binary.LittleEndian.Uint32(raw[12:16]),
		cgroupID: binary.LittleEndian.Uint64(raw[20:28]),
		ktime:    binary.LittleEndian.Uint64(raw[28:36]),
		payload:  bytes.Clone(raw[RecordHeaderLen:]),
	}, nil
}

// collector reads records until its context is done and the ring is drained.
type collector struct {
	mu      sync.Mutex
	bySport map[uint16][]record
	records int
	err     error
	done    chan struct{}
}

func collect(ctx context.Context, l *TCPLogger, delay time.Duration) *collector {
	c := &collector{bySport: map[uint16][]record{}, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		// ReadBatch hands out records in place. Every 7th record is refused
		// once: it must stay in the ring and come first in the next batch.
		errRefused := errors.New("refused")
		var refused []byte
		calls := 0
		handle := func(raw []byte) error {
			calls++
			if refused != nil {
				if !bytes.Equal(raw, refused) {
					return fmt.Errorf("after refusing a record of %d bytes the next batch started with a different one of %d bytes", len(refused), len(raw))
				}
				refused = nil
			} else if calls%7 == 0 {
				refused = bytes.Clone(raw)
				return errRefused
			}
			r, err := parseRecord(raw) // copies the payload out of the ring
			if err != nil {
				return err
			}
			c.mu.Lock()
			c.bySport[r.sport] = append(c.bySport[r.sport], r)
			c.records++
			c.mu.Unlock()
			if delay > 0 {
				time.Sleep(delay) // a slow consumer
			}
			return nil
		}
		for {
			_, err := l.ReadBatch(ctx, 0, handle)
			if err != nil && !errors.Is(err, errRefused) {
				if ctx.Err() == nil || !errors.Is(err, ctx.Err()) {
					c.err = err
				}
				return
			}
		}
	}()
	return c
}

// reassemble orders a flow's records by sequence number into the byte
// stream, checking that overlapping records (retransmissions) agree and that
// nothing is missing between the first and the last byte. Sequence numbers
// are unwrapped relative to the first record: streams are < 2 GiB.
func reassemble(recs []record) (data []byte, dupBytes int, err error) {
	if len(recs) == 0 {
		return nil, 0, errors.New("no records")
	}
	type seg struct {
		off  int64
		data []byte
	}
	segs := make([]seg, len(recs))
	for i, r := range recs {
		segs[i] = seg{int64(int32(r.seq - recs[0].seq)), r.payload}
	}
	slices.SortStableFunc(segs, func(a, b seg) int { return int(a.off - b.off) })
	start := segs[0].off
	for _, s := range segs {
		pos := s.off - start // where s starts in data
		have := int64(len(data))
		if pos > have {
			return nil, 0, fmt.Errorf("hole of %d bytes at stream offset %d", pos-have, have)
		}
		overlap := min(have-pos, int64(len(s.data)))
		if !bytes.Equal(data[pos:pos+overlap], s.data[:overlap]) {
			return nil, 0, fmt.Errorf("retransmitted bytes at stream offset %d differ from the first copy", pos)
		}
		dupBytes += int(overlap)
		data = append(data, s.data[overlap:]...)
	}
	return data, dupBytes, nil
}

func requirePrivileges(t testing.TB) {
	t.Helper()
	testenv.RequireKernel(t, "BPF, network namespaces and cgroups")
}

type scenario struct {
	ring       int           // ring buffer bytes
	size       int           // bytes the protected sender sends
	delay      time.Duration // consumer sleep per record
	basePort   int           // receivers listen on basePort, +1, +2
	localPort  int           // the port-protected sender's local port
	wantDrops  bool
	seed       uint64
	sideBytes  int // bytes of the unprotected and the port-protected flows
	timeoutSec int
	runTime    bool // enable BPF statistics and check TCPLogger.RunTime
}

// TestTCPLoggerEndToEnd sends three flows from lab host a to host b with the
// logger on a's eth0 egress: one from a protected cgroup,
// one from an unprotected cgroup, and one from the unprotected cgroup whose
// local port is protected. It rebuilds the logged flows from the records and
// compares them with what was sent.
func TestTCPLoggerEndToEnd(t *testing.T) {
	requirePrivileges(t)
	tn := newTestNet(t)
	protected := streamtest.NewCgroupT(t, "protected")
	other := streamtest.NewCgroupT(t, "other")

	t.Run("lossless", func(t *testing.T) {
		runScenario(t, tn, protected, other, scenario{
			ring: 64 << 20, size: 32 << 20, basePort: 5001, localPort: 40001,
			seed: 1, sideBytes: 4 << 20, timeoutSec: 30, runTime: true,
		})
	})
	t.Run("backpressure", func(t *testing.T) {
		// A 1 MiB ring and a consumer that sleeps 1 ms after each record:
		// the program must drop segments and TCP retransmit them.
		runScenario(t, tn, protected, other, scenario{
			ring: 1 << 20, size: 20 << 20, delay: time.Millisecond, basePort: 5011, localPort: 40011,
			wantDrops: true, seed: 2, sideBytes: 2 << 20, timeoutSec: 60,
		})
	})
	t.Run("tiny-ring", func(t *testing.T) {
		// 64 KiB holds exactly one full GSO segment (65,160 bytes of
		// payload plus 44 bytes of headers). Every drop stalls the flow
		// with nothing in flight until the consumer's kick once the ring is
		// drained (before it, TCP's probe timer: 200 ms, then 500 ms, under
		// 1 MiB/s here): the stream is kept small.
		runScenario(t, tn, protected, other, scenario{
			ring: 64 << 10, size: 256 << 10, delay: 200 * time.Microsecond, basePort: 5021, localPort: 40021,
			wantDrops: true, seed: 3, sideBytes: 64 << 10, timeoutSec: 60,
		})
	})
}

func runScenario(t *testing.T, tn *testNet, protected, other *streamtest.Cgroup, sc scenario) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Duration(sc.timeoutSec)*time.Second)
	defer cancel()

	l, err := NewTCPLogger(TCPLoggerOptions{RingBufferSize: sc.ring})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load the TCX logger: %v", err)
	}
	if err != nil {
		t.Fatalf("NewTCPLogger: %+v", err)
	}
	t.Cleanup(func() {
		if err := l.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	if err := l.Protect(protected.ID); err != nil {
		t.Fatal(err)
	}
	if err := l.ProtectPort(uint16(sc.localPort)); err != nil {
		t.Fatal(err)
	}
	if err := tn.attach(l, hostA); err != nil {
		t.Fatalf("Attach: %v", err)
	}

	type flow struct {
		name   string
		cg     *streamtest.Cgroup
		size   int
		seed   uint64
		lport  int
		logged bool
		recv   *streamtest.Child
		send   *streamtest.Child
		sport  uint16
	}
	flows := []*flow{
		{name: "protected-cgroup", cg: protected, size: sc.size, seed: sc.seed * 10, logged: true},
		{name: "unprotected", cg: other, size: sc.sideBytes, seed: sc.seed*10 + 1},
		{name: "protected-port", cg: other, size: sc.sideBytes, seed: sc.seed*10 + 2, lport: sc.localPort, logged: true},
	}
	for i, f := range flows {
		addr := fmt.Sprintf("FTKIT_ADDR=%s:%d", tn.ipB, sc.basePort+i)
		f.recv = streamtest.StartT(t, tn.lab, hostB, nil, "recv", addr)
		if l := f.recv.LineT(ctx, t); l != "ready" {
			t.Fatalf("receiver %s said %q", f.name, l)
		}
	}

	if sc.runTime {
		stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
		if err != nil {
			t.Fatalf("enable BPF run time statistics: %v", err)
		}
		defer stats.Close()
	}
	col := collect(ctx, l, sc.delay)
	start := time.Now()
	for i, f := range flows {
		env := []string{
			fmt.Sprintf("FTKIT_ADDR=%s:%d", tn.ipB, sc.basePort+i),
			fmt.Sprintf("FTKIT_SEED=%d", f.seed),
			fmt.Sprintf("FTKIT_SIZE=%d", f.size),
		}
		if f.lport != 0 {
			env = append(env, fmt.Sprintf("FTKIT_LPORT=%d", f.lport))
		}
		f.send = streamtest.StartT(t, tn.lab, hostA, f.cg, "send", env...)
	}
	for _, f := range flows {
		src, _, err := streamtest.ParseConnLine(f.send.LineT(ctx, t))
		if err != nil {
			t.Fatalf("sender %s: %v", f.name, err)
		}
		f.sport = src.Port()
	}
	var total int
	for _, f := range flows {
		want := fmt.Sprintf("%d %x", f.size, sha256.Sum256(streamtest.Stream(f.seed, f.size)))
		if got := f.recv.LineT(ctx, t); got != want {
			t.Fatalf("receiver of %s got %q, want %q", f.name, got, want)
		}
		total += f.size
	}
	elapsed := time.Since(start)
	// Every byte received passed the program, which logged it first: drain
	// what is left in the ring and stop.
	cancel()
	<-col.done
	if col.err != nil {
		t.Fatalf("reading records: %v", col.err)
	}
	cnt, err := l.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%.2f MiB in %v (%.1f MiB/s), %d records; counters %+v",
		float64(total)/(1<<20), elapsed.Round(time.Millisecond), float64(total)/(1<<20)/elapsed.Seconds(), col.records, cnt)

	for _, f := range flows {
		recs := col.bySport[f.sport]
		if !f.logged {
			if len(recs) != 0 {
				t.Errorf("%s flow (port %d) was logged: %d records", f.name, f.sport, len(recs))
			}
			continue
		}
		data, dups, err := reassemble(recs)
		if err != nil {
			t.Errorf("%s flow: %v", f.name, err)
			continue
		}
		want := streamtest.Stream(f.seed, f.size)
		if len(data) != len(want) || sha256.Sum256(data) != sha256.Sum256(want) {
			t.Errorf("%s flow: reassembled %d bytes (sha256 %x), sent %d (sha256 %x)",
				f.name, len(data), sha256.Sum256(data), len(want), sha256.Sum256(want))
		}
		for _, r := range recs {
			if r.cgroupID != f.cg.ID {
				t.Errorf("%s flow: record has cgroup id %d, want %d", f.name, r.cgroupID, f.cg.ID)
				break
			}
			if r.saddr != tn.ipA || r.daddr != tn.ipB || r.ktime == 0 {
				t.Errorf("%s flow: bad record header %+v", f.name, r)
				break
			}
		}
		t.Logf("%s flow: %d records, %d bytes, %d duplicate bytes", f.name, len(recs), len(data), dups)
	}
	if cnt.DropsOversize != 0 || cnt.DropsError != 0 || cnt.FragmentsPassed != 0 {
		t.Errorf("unexpected counters %+v", cnt)
	}
	if logged := uint64(sc.size + sc.sideBytes); cnt.BytesLogged < logged {
		t.Errorf("counters say %d bytes logged, want at least %d", cnt.BytesLogged, logged)
	}
	if sc.runTime {
		// Every logged packet was one run, and every run took some time; unprotected packets ran too.
		rt, runs, err := l.RunTime()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("program: %d runs, %v (%.1f ns per logged KiB)", runs, rt, float64(rt.Nanoseconds())/(float64(cnt.BytesLogged)/1024))
		if runs < cnt.PacketsLogged || rt <= 0 {
			t.Errorf("RunTime: %v over %d runs, want > 0 over at least the %d packets logged", rt, runs, cnt.PacketsLogged)
		}
	}
	if sc.wantDrops && cnt.DropsBackpressure == 0 {
		t.Errorf("no backpressure drops with a %d-byte ring and a slow consumer", sc.ring)
	}
}

// TestTCPLoggerAPI checks the control calls and that a blocked Read stops on
// context cancellation and on Close.
func TestTCPLoggerAPI(t *testing.T) {
	requirePrivileges(t)
	l, err := NewTCPLogger(TCPLoggerOptions{RingBufferSize: 64 << 10})
	if errors.Is(err, ebpf.ErrNotSupported) {
		t.Skipf("SKIPPED: this kernel cannot load the TCX logger: %v", err)
	}
	if err != nil {
		t.Fatalf("NewTCPLogger: %+v", err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			l.Close()
		}
	})
	f := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.250.7.1:40000"), Remote: netip.MustParseAddrPort("10.250.7.2:5001")}
	for _, step := range []func() error{
		func() error { return l.Protect(7) },
		func() error { return l.Unprotect(7) },
		func() error { return l.Unprotect(7) }, // idempotent
		func() error { return l.ProtectPort(40000) },
		func() error { return l.UnprotectPort(40000) },
		func() error { return l.ProtectFlow(f) },
		func() error { return l.UnprotectFlow(f) },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	if c, err := l.Counters(); err != nil || c != (Counters{}) {
		t.Fatalf("Counters() = %+v, %v; want zero", c, err)
	}
	if err := l.Attach(1 << 30); err == nil {
		t.Error("Attach to a missing interface succeeded")
	}

	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if _, err := l.Read(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Read on an empty ring with a 50 ms deadline: %v", err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := l.Read(t.Context())
		errc <- err
	}()
	time.Sleep(20 * time.Millisecond) // let Read block
	closed = true
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("Read after Close: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not interrupt Read")
	}
}

// TestTCPLoggerMaxFlows: the live states' map has as many entries as asked (the default without a
// number), as the kernel reports it; a number out of bounds is refused before anything is loaded.
func TestTCPLoggerMaxFlows(t *testing.T) {
	for _, bad := range []int{-1, MaxMaxFlows + 1} {
		if l, err := NewTCPLogger(TCPLoggerOptions{RingBufferSize: 64 << 10, MaxFlows: bad}); err == nil {
			l.Close()
			t.Errorf("%d flows accepted", bad)
		}
	}
	requirePrivileges(t)
	for _, c := range []struct{ asked, want int }{{0, DefaultMaxFlows}, {2048, 2048}} {
		l, err := NewTCPLogger(TCPLoggerOptions{RingBufferSize: 64 << 10, MaxFlows: c.asked})
		if errors.Is(err, ebpf.ErrNotSupported) {
			t.Skipf("SKIPPED: this kernel cannot load the TCX logger: %v", err)
		}
		if err != nil {
			t.Fatalf("NewTCPLogger: %+v", err)
		}
		info, err := l.objs.FlowStates.Info()
		l.Close()
		if err != nil {
			t.Fatal(err)
		}
		if info.MaxEntries != uint32(c.want) {
			t.Errorf("MaxFlows %d: the kernel's map has %d entries, want %d", c.asked, info.MaxEntries, c.want)
		}
	}
}
