package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/tcpflow"
)

// logCycle settings: one connection logged at 1 Gbit/s for a first fill and then cycles, trimmed at the
// end of each as its receiver's snapshot would, the log aged every 5 s as netlog/node does.
const (
	cycleRate   = 125e6 // bytes per second
	cycleLen    = 20 * time.Second
	cycleCount  = 3 // after the first fill
	cycleRecord = 64 << 10
	cyclePoll   = 40 * time.Millisecond // capture.DefaultPollInterval: what one drain of the ring appends
	cycleAge    = 5 * time.Second       // netlog/node's Age period
)

// cycleWindow is what appending cost the appending thread over part of a logCycle run.
type cycleWindow struct {
	cpuPerGB, faultsPerGB float64
}

// logCycle measures what appending to a log costs its consumer's thread, CPU and page faults per GB, over
// the log's life in an agent: the first fill, in fresh memory, and the cycles after it, which reuse what
// the trims freed as long as the log keeps it (netlog.Options.PoolKeep). The network bench's transfers
// are too short and trimmed too often to see the difference: a log trimmed every 50 ms needs a few MiB.
func logCycle(ctx context.Context) (first, steady cycleWindow, err error) {
	ctx, cancel := context.WithCancel(ctx) // an Age that fails stops the appender too
	defer cancel()
	l, err := netlog.NewLog(netlog.Options{})
	if err != nil {
		return first, steady, err
	}
	defer l.Close()
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.247.0.11:40000"), Remote: netip.MustParseAddrPort("10.247.0.12:7000")}
	src := make([]byte, 64<<20) // a ring's worth of payload to copy from
	_, _ = rand.NewChaCha8([32]byte{4}).Read(src)

	type result struct {
		windows []cycleWindow
		err     error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // RUSAGE_THREAD must be this goroutine's thread's alone
		defer runtime.UnlockOSThread()
		var res result
		defer func() { done <- res }()
		var seq uint32 = 1
		off := 0
		for range 1 + cycleCount {
			var before, after unix.Rusage
			if res.err = unix.Getrusage(unix.RUSAGE_THREAD, &before); res.err != nil {
				return
			}
			start, sent := time.Now(), 0.0
			for time.Since(start) < cycleLen {
				if res.err = ctx.Err(); res.err != nil {
					return
				}
				for want := time.Since(start).Seconds() * cycleRate; sent < want; sent += cycleRecord {
					if off+cycleRecord > len(src) {
						off = 0
					}
					if res.err = l.Append(netlog.Record{Conn: conn, Seq: seq, Payload: src[off : off+cycleRecord]}); res.err != nil {
						return
					}
					seq += cycleRecord
					off += cycleRecord
				}
				time.Sleep(cyclePoll)
			}
			if res.err = unix.Getrusage(unix.RUSAGE_THREAD, &after); res.err != nil {
				return
			}
			cpu := time.Duration(after.Utime.Nano() + after.Stime.Nano() - before.Utime.Nano() - before.Stime.Nano())
			gb := sent / 1e9
			res.windows = append(res.windows, cycleWindow{cpuPerGB: cpu.Seconds() / gb, faultsPerGB: float64(after.Minflt-before.Minflt) / gb})
			// The receiver's snapshot: everything logged so far goes.
			if _, res.err = l.Trim(conn, seq); res.err != nil {
				return
			}
		}
	}()
	age := time.NewTicker(cycleAge)
	defer age.Stop()
	for {
		select {
		case res := <-done:
			if res.err != nil {
				return first, steady, fmt.Errorf("log cycle: %w", res.err)
			}
			var cpu, faults []float64
			for _, w := range res.windows[1:] {
				cpu, faults = append(cpu, w.cpuPerGB), append(faults, w.faultsPerGB)
			}
			return res.windows[0], cycleWindow{cpuPerGB: median(cpu), faultsPerGB: median(faults)}, nil
		case now := <-age.C:
			if _, err := l.Age(ctx, now); err != nil {
				cancel()
				<-done
				return first, steady, fmt.Errorf("log cycle: age: %w", err)
			}
		}
	}
}
