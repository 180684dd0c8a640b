// Command nondet is a two-rank ping-pong over TCP for ftkit's tests of re-sent byte verification. Rank 1
// sends a block per iteration and waits for rank 0's acknowledgement. With --clock, each block's bytes are
// drawn from a generator seeded with the wall clock at the moment it is sent, so a rank 1 restored from a
// snapshot re-sends different bytes than its peer already received (a non-deterministic program); without
// it the blocks depend only on the iteration, and a restore re-sends the same bytes. With --oneway rank 0
// never answers and rank 1 never waits: a one-way stream, whose receiver sends no payload at all. With
// --resync-after D, rank 1 decides from the wall clock, as programs with timeouts do: when more than D passed
// since its previous iteration started, it sends a resync request (a block of 0xff bytes) instead of the next block
// and waits for a block-sized answer. A failure-free run never pauses that long; a rank 1 restored from a
// snapshot taken more than D before its restore takes the other branch, and waits for an answer its peer,
// which never sees the request (TCP drops it as a duplicate), will never send: a diverged, blocked rank.
// --progress N makes each rank print a line every N blocks ("rank 0 received K blocks", "rank 1 sent K
// blocks"), which tests wait on; --gate FILE --gate-at K holds rank 1 before block K until FILE exists, so
// that a stream cannot end before the faults a test injects, however slow the machine. Neither changes a
// byte on the wire.
//
//	nondet --rank R --peer ADDR [--iters N] [--block BYTES] [--delay D] [--clock] [--oneway] [--resync-after D]
//	       [--progress N] [--gate FILE --gate-at K]
//
// Rank 0 listens on ADDR, rank 1 connects to it. Both print "rank R checksum X" (a SHA-256 of the blocks
// received or sent) and exit 0 when all iterations are done.
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"time"
)

func main() {
	rank := flag.Int("rank", 0, "0 (receiver) or 1 (sender)")
	peer := flag.String("peer", "", "host:port rank 0 listens on")
	iters := flag.Int("iters", 500, "iterations")
	block := flag.Int("block", 64<<10, "bytes rank 1 sends per iteration")
	delay := flag.Duration("delay", 10*time.Millisecond, "pause between iterations")
	clock := flag.Bool("clock", false, "seed each block with the wall clock (non-deterministic)")
	oneway := flag.Bool("oneway", false, "rank 0 sends no acknowledgements, rank 1 waits for none")
	resync := flag.Duration("resync-after", 0, "rank 1: after a pause longer than this, ask rank 0 to resync (0: never)")
	progress := flag.Int("progress", 0, "print a progress line every N blocks (0: never)")
	gate := flag.String("gate", "", "rank 1 waits before sending block --gate-at (with --eof, before it closes when --gate-at is --iters), rank 0 before reading it, until this file exists")
	gateAt := flag.Int("gate-at", 0, "the block --gate holds the rank before")
	eof := flag.Bool("eof", false, "with --oneway: rank 1 closes its side after its last block and waits for rank 0 to close; rank 0 reads to the end of the stream, then closes")
	flag.Parse()
	if *peer == "" || *rank < 0 || *rank > 1 || *block < 8 || *block%8 != 0 {
		fmt.Fprintln(os.Stderr, "nondet: need --peer, --rank 0 or 1, --block a multiple of 8")
		os.Exit(2)
	}
	if *eof && !*oneway {
		fmt.Fprintln(os.Stderr, "nondet: --eof needs --oneway")
		os.Exit(2)
	}
	wait := func(int) {}
	if *gate != "" {
		wait = func(i int) {
			for i == *gateAt {
				if _, err := os.Stat(*gate); err == nil {
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
	var sum string
	var err error
	if *rank == 0 {
		sum, err = receive(*peer, *iters, *block, *oneway, *eof, *progress, wait)
	} else {
		sum, err = send(*peer, *iters, *block, *delay, *clock, *oneway, *eof, *resync, *progress, wait)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "nondet rank %d: %v\n", *rank, err)
		os.Exit(1)
	}
	fmt.Printf("rank %d checksum %s\n", *rank, sum)
}

func receive(addr string, iters, block int, oneway, eof bool, progress int, gate func(i int)) (string, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", err
	}
	c, err := ln.Accept()
	if err != nil {
		return "", err
	}
	ln.Close()
	h := sha256.New()
	buf := make([]byte, block)
	ack := make([]byte, 8)
	for i := 0; eof || i < iters; i++ {
		gate(i)
		n, err := io.ReadFull(c, buf)
		if eof && n == 0 && err == io.EOF {
			if err := c.Close(); err != nil {
				return "", err
			}
			fmt.Printf("rank 0 read the end of the stream after %d blocks\n", i)
			break
		}
		if err != nil {
			return "", fmt.Errorf("iteration %d: read block: %w", i, err)
		}
		if isResync(buf) {
			// A resync request: answer with a block of its own instead of an acknowledgement.
			if _, err := c.Write(buf); err != nil {
				return "", fmt.Errorf("iteration %d: answer resync: %w", i, err)
			}
			i--
			continue
		}
		h.Write(buf)
		if progress > 0 && (i+1)%progress == 0 {
			fmt.Printf("rank 0 received %d blocks\n", i+1)
		}
		if oneway {
			continue
		}
		binary.LittleEndian.PutUint64(ack, uint64(i))
		if _, err := c.Write(ack); err != nil {
			return "", fmt.Errorf("iteration %d: acknowledge: %w", i, err)
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// isResync says whether a block is a resync request (all 0xff; a generated block never is).
func isResync(b []byte) bool {
	for _, x := range b {
		if x != 0xff {
			return false
		}
	}
	return true
}

func send(addr string, iters, block int, delay time.Duration, clock, oneway, eof bool, resync time.Duration, progress int, gate func(i int)) (string, error) {
	var c net.Conn
	var err error
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err = net.Dial("tcp", addr); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		return "", err
	}
	h := sha256.New()
	buf := make([]byte, block)
	ack := make([]byte, 8)
	// The wall clock (Round(0) drops the monotonic reading): measured, a restored copy deciding on the
	// monotonic reading saw no outage and did not diverge (docs/design.md); the wall clock shows it.
	now := func() time.Time { return time.Now().Round(0) }
	prev := now() // when the previous iteration started
	for i := 0; i < iters; i++ {
		if resync > 0 && now().Sub(prev) > resync {
			// The previous iteration took too long (a program's timeout branch): resync with rank 0.
			for off := range buf {
				buf[off] = 0xff
			}
			if _, err := c.Write(buf); err != nil {
				return "", fmt.Errorf("iteration %d: send resync: %w", i, err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				return "", fmt.Errorf("iteration %d: read resync answer: %w", i, err)
			}
			prev = now()
			i--
			continue
		}
		gate(i) // before prev: a held stream is not a pause of the program's
		prev = now()
		seed := uint64(i)
		if clock {
			seed = uint64(time.Now().UnixNano()) // read when the block is sent: a re-execution differs
		}
		r := rand.New(rand.NewPCG(seed, 0x6e6f6e646574))
		for off := 0; off < len(buf); off += 8 {
			binary.LittleEndian.PutUint64(buf[off:], r.Uint64())
		}
		h.Write(buf)
		if _, err := c.Write(buf); err != nil {
			return "", fmt.Errorf("iteration %d: send block: %w", i, err)
		}
		if progress > 0 && (i+1)%progress == 0 {
			fmt.Printf("rank 1 sent %d blocks\n", i+1)
		}
		if oneway {
			time.Sleep(delay)
			continue
		}
		if _, err := io.ReadFull(c, ack); err != nil {
			return "", fmt.Errorf("iteration %d: read acknowledgement: %w", i, err)
		}
		if got := binary.LittleEndian.Uint64(ack); got != uint64(i) {
			return "", fmt.Errorf("iteration %d: acknowledgement for %d", i, got)
		}
		time.Sleep(delay)
	}
	if eof {
		gate(iters) // --gate-at equal to --iters holds it before it closes
		if err := c.(*net.TCPConn).CloseWrite(); err != nil {
			return "", fmt.Errorf("close the sending side: %w", err)
		}
		fmt.Println("rank 1 closed its sending side")
		if _, err := io.Copy(io.Discard, c); err != nil {
			return "", fmt.Errorf("wait for rank 0 to close: %w", err)
		}
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
