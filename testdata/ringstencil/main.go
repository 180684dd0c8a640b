// Command ringstencil is a small SPMD program for ftkit's demo and failover tests: N ranks on a ring, each
// exchanging a halo block with both neighbours over TCP every iteration, then folding what it received into
// its state. The final checksum (the same on every rank) depends on every byte exchanged, so a failover that
// loses, duplicates or reorders a single byte changes it.
//
//	ringstencil --rank R --peers ADDR0,ADDR1,... [--iters N] [--block BYTES] [--delay D] [--seed S]
//	            [--gate FILE --gate-at K]
//
// With --gate, rank 0 waits before iteration K until FILE exists, and the whole ring with it: a test that
// injects faults first releases the run afterwards, so that the run cannot end before them however slow
// the machine is. The gate changes no byte the ranks exchange.
//
// Rank r listens on ADDRr, connects to rank r+1 and accepts rank r-1; each connection carries traffic in
// both directions.
package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"
)

func main() {
	rank := flag.Int("rank", 0, "this process's rank")
	peers := flag.String("peers", "", "comma-separated host:port of every rank, in rank order")
	iters := flag.Int("iters", 200, "iterations")
	block := flag.Int("block", 64<<10, "bytes sent to each neighbour per iteration")
	delay := flag.Duration("delay", 0, "compute time per iteration (sleep)")
	seed := flag.Uint64("seed", 1, "seed of the initial state")
	progress := flag.Int("progress", 0, "print a progress line every N iterations (0: never)")
	ballast := flag.Int("ballast", 0, "MiB of resident memory to hold (a job with a realistic footprint to snapshot)")
	gate := flag.String("gate", "", "rank 0 waits before iteration --gate-at until this file exists")
	gateAt := flag.Int("gate-at", 0, "the iteration --gate holds rank 0 before")
	flag.Parse()
	addrs := strings.Split(*peers, ",")
	if *peers == "" || len(addrs) < 2 || *rank < 0 || *rank >= len(addrs) || *block < 32 {
		fmt.Fprintln(os.Stderr, "ringstencil: need --peers with at least 2 addresses, 0 <= --rank < len(peers), --block >= 32")
		os.Exit(2)
	}
	held := fillBallast(*ballast, *seed)
	wait := func(int) {}
	if *gate != "" && *rank == 0 {
		wait = func(it int) {
			for it == *gateAt {
				if _, err := os.Stat(*gate); err == nil {
					return
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
	sum, err := run(*rank, addrs, *iters, *block, *delay, *seed, *progress, wait)
	if err != nil {
		fmt.Fprintf(os.Stderr, "ringstencil rank %d: %v\n", *rank, err)
		os.Exit(1)
	}
	// The ballast is checked too: a restore that lost memory (a page read back as zeros) must not pass
	// for a correct run because the pages it lost held no state of the exchange.
	if !bytes.Equal(held, fillBallast(*ballast, *seed)) {
		fmt.Fprintf(os.Stderr, "ringstencil rank %d: the ballast's content changed\n", *rank)
		os.Exit(1)
	}
	fmt.Printf("rank %d checksum %s\n", *rank, sum)
}

// fillBallast allocates and touches mb MiB (incompressible bytes, so snapshots and shipping pay for them).
func fillBallast(mb int, seed uint64) []byte {
	if mb <= 0 {
		return nil
	}
	b := make([]byte, mb<<20)
	var ctr [16]byte
	binary.LittleEndian.PutUint64(ctr[:], seed)
	for off, i := 0, uint64(0); off < len(b); i++ {
		binary.LittleEndian.PutUint64(ctr[8:], i)
		s := sha256.Sum256(ctr[:])
		off += copy(b[off:], s[:])
	}
	return b
}

func run(rank int, addrs []string, iters, block int, delay time.Duration, seed uint64, progress int, gate func(it int)) (string, error) {
	n := len(addrs)
	ln, err := net.Listen("tcp", addrs[rank])
	if err != nil {
		return "", fmt.Errorf("listen: %w", err)
	}
	right, err := dialRetry(addrs[(rank+1)%n], 30*time.Second)
	if err != nil {
		return "", err
	}
	left, err := ln.Accept()
	if err != nil {
		return "", fmt.Errorf("accept left neighbour: %w", err)
	}
	ln.Close()

	state := sha256.Sum256(binary.LittleEndian.AppendUint64([]byte("ringstencil"), seed+uint64(rank)))
	out, fromLeft, fromRight := make([]byte, block), make([]byte, block), make([]byte, block)
	for it := 0; it < iters; it++ {
		gate(it)
		fill(out, state, it)
		if err := exchange(left, right, out, fromLeft, fromRight); err != nil {
			return "", fmt.Errorf("iteration %d: %w", it, err)
		}
		h := sha256.New()
		h.Write(state[:])
		h.Write(fromLeft)
		h.Write(fromRight)
		copy(state[:], h.Sum(nil))
		if delay > 0 {
			time.Sleep(delay)
		}
		if progress > 0 && (it+1)%progress == 0 {
			fmt.Printf("rank %d iteration %d\n", rank, it+1)
		}
	}
	// Ring allgather of the final states: n-1 steps to the right.
	all := make([][32]byte, n)
	all[rank] = state
	carry := state
	for step := 1; step < n; step++ {
		var got [32]byte
		if err := exchangeRight(left, right, carry[:], got[:]); err != nil {
			return "", fmt.Errorf("allgather step %d: %w", step, err)
		}
		all[(rank-step+n)%n] = got
		carry = got
	}
	h := sha256.New()
	for _, s := range all {
		h.Write(s[:])
	}
	right.Close()
	left.Close()
	return hex.EncodeToString(h.Sum(nil)), nil
}

// fill derives this iteration's outgoing block from the state (SHA-256 in counter mode).
func fill(out []byte, state [32]byte, it int) {
	var ctr [44]byte
	copy(ctr[:], state[:])
	binary.LittleEndian.PutUint32(ctr[32:], uint32(it))
	for off, i := 0, uint32(0); off < len(out); i++ {
		binary.LittleEndian.PutUint32(ctr[36:], i)
		s := sha256.Sum256(ctr[:])
		off += copy(out[off:], s[:])
	}
}

// exchange sends out to both neighbours and reads one block from each, concurrently so that blocks larger
// than the socket buffers cannot deadlock the ring.
func exchange(left, right net.Conn, out, fromLeft, fromRight []byte) error {
	errc := make(chan error, 4)
	go func() { _, err := left.Write(out); errc <- err }()
	go func() { _, err := right.Write(out); errc <- err }()
	go func() { _, err := io.ReadFull(left, fromLeft); errc <- err }()
	go func() { _, err := io.ReadFull(right, fromRight); errc <- err }()
	var errs []error
	for range 4 {
		errs = append(errs, <-errc)
	}
	return errors.Join(errs...)
}

func exchangeRight(left, right net.Conn, out, in []byte) error {
	errc := make(chan error, 2)
	go func() { _, err := right.Write(out); errc <- err }()
	go func() { _, err := io.ReadFull(left, in); errc <- err }()
	return errors.Join(<-errc, <-errc)
}

func dialRetry(addr string, timeout time.Duration) (net.Conn, error) {
	deadline := time.Now().Add(timeout)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			return c, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("connect to right neighbour %s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
