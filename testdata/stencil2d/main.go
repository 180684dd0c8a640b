// Command stencil2d is an SPMD 2-D Jacobi stencil over TCP, the workload of ftbench's "compare" benchmark:
// N ranks split a G x G float64 grid into blocks of rows, and every iteration each rank exchanges its first
// and last row with its up and down neighbours (rows are periodic, so the ranks form a ring; columns 0 and
// G-1 are fixed), then relaxes its block. The run is deterministic; the final line is
// "rank R checksum HEX", the same on every rank: a hash of every rank's block, gathered around the ring.
//
//	stencil2d --rank R --peers ADDR0,ADDR1,... [--grid G] [--iters N] [--delay D]
//	          [--ckpt-dir DIR --ckpt-every K [--restart]] [--report-at I]
//
// With --ckpt-dir, it checkpoints at the application level, FT-SPMD style: every K-th superstep boundary
// (where no halo is in flight) each rank writes its block and the iteration number to
// DIR/rank-R-iter-I.ckpt (checksummed; write, fsync, rename), then the ranks agree over the ring that all
// of them wrote it before each deletes its older files. --restart makes every rank load the newest
// checkpoint that all ranks completed and continue from there (a global rollback).
//
// Lines on stdout: "rank R resumed from iteration I at UNIXNANO" after a restart, "rank R reached
// iteration I at UNIXNANO" for --report-at I, "rank R stopped at iteration I" when SIGTERMed (how a
// benchmark learns how far the ranks had got), then the checksum line.
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

type config struct {
	rank       int
	addrs      []string
	grid       int
	iters      int
	delay      time.Duration
	ckptDir    string
	ckptEvery  int
	restart    bool
	reportAt   int
	endAfter   string
	progress   *atomic.Int64 // iterations completed, read by the SIGTERM handler
	stderr     io.Writer
	stdout     io.Writer
	listenWait time.Duration
}

func main() {
	var cfg config
	peers := flag.String("peers", "", "comma-separated host:port of every rank, in rank order")
	flag.IntVar(&cfg.rank, "rank", 0, "this process's rank")
	flag.IntVar(&cfg.grid, "grid", 512, "grid size G (G x G float64)")
	flag.IntVar(&cfg.iters, "iters", 1000, "iterations (supersteps)")
	flag.DurationVar(&cfg.delay, "delay", 0, "extra compute time per iteration (sleep)")
	flag.StringVar(&cfg.ckptDir, "ckpt-dir", "", "directory for application-level checkpoints (shared by all ranks)")
	flag.IntVar(&cfg.ckptEvery, "ckpt-every", 0, "checkpoint every K iterations (needs --ckpt-dir)")
	flag.BoolVar(&cfg.restart, "restart", false, "resume from the newest checkpoint all ranks completed")
	flag.IntVar(&cfg.reportAt, "report-at", 0, "print when iteration I is done (how a benchmark times catching up)")
	flag.StringVar(&cfg.endAfter, "end-after", "", "after the last iteration, wait until this file exists (a benchmark that crashes this rank's host keeps it running until it is protected)")
	flag.Parse()
	cfg.addrs = strings.Split(*peers, ",")
	if err := cfg.validate(*peers); err != nil {
		fmt.Fprintln(os.Stderr, "stencil2d:", err)
		os.Exit(2)
	}
	cfg.progress = new(atomic.Int64)
	cfg.stdout, cfg.stderr, cfg.listenWait = os.Stdout, os.Stderr, 60*time.Second

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM)
	go func() {
		<-sigs
		fmt.Printf("rank %d stopped at iteration %d\n", cfg.rank, cfg.progress.Load())
		os.Exit(143)
	}()

	sum, err := run(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "stencil2d rank %d: %v\n", cfg.rank, err)
		os.Exit(1)
	}
	fmt.Printf("rank %d checksum %s\n", cfg.rank, sum)
}

func (c *config) validate(peers string) error {
	n := len(c.addrs)
	switch {
	case peers == "" || n < 2:
		return errors.New("need --peers with at least 2 addresses")
	case c.rank < 0 || c.rank >= n:
		return fmt.Errorf("--rank %d: want 0 <= rank < %d", c.rank, n)
	case c.grid < 3 || c.grid < n:
		return fmt.Errorf("--grid %d: want at least 3 and at least one row per rank (%d ranks)", c.grid, n)
	case c.iters < 0:
		return errors.New("--iters must not be negative")
	case c.ckptEvery < 0 || (c.ckptEvery > 0) != (c.ckptDir != ""):
		return errors.New("--ckpt-dir and --ckpt-every K > 0 go together")
	case c.restart && c.ckptDir == "":
		return errors.New("--restart needs --ckpt-dir")
	}
	return nil
}

// rowsOf is the block of rows rank r owns: [row0, row0+rows).
func rowsOf(r, ranks, grid int) (row0, rows int) {
	row0 = r * grid / ranks
	return row0, (r+1)*grid/ranks - row0
}

// initial is the deterministic starting value of a cell.
func initial(i, j int) float64 { return float64((i*131+j*71)%1000) / 1000 }

// ring holds the two persistent connections: up (accepted from rank-1) and down (dialled to rank+1).
type ring struct{ up, down net.Conn }

func connect(c config) (*ring, error) {
	n := len(c.addrs)
	ln, err := net.Listen("tcp", c.addrs[c.rank])
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", c.addrs[c.rank], err)
	}
	defer ln.Close()
	down, err := dialRetry(c.addrs[(c.rank+1)%n], c.listenWait)
	if err != nil {
		return nil, err
	}
	if tl, ok := ln.(*net.TCPListener); ok {
		tl.SetDeadline(time.Now().Add(c.listenWait))
	}
	up, err := ln.Accept()
	if err != nil {
		down.Close()
		return nil, fmt.Errorf("accept the up neighbour: %w", err)
	}
	return &ring{up: up, down: down}, nil
}

func (r *ring) close() { r.up.Close(); r.down.Close() }

// halo sends toUp and toDown and fills fromUp and fromDown, concurrently so that rows larger than the socket
// buffers cannot deadlock the ring.
func (r *ring) halo(toUp, toDown, fromUp, fromDown []byte) error {
	errc := make(chan error, 4)
	go func() { _, err := r.up.Write(toUp); errc <- err }()
	go func() { _, err := r.down.Write(toDown); errc <- err }()
	go func() { _, err := io.ReadFull(r.up, fromUp); errc <- err }()
	go func() { _, err := io.ReadFull(r.down, fromDown); errc <- err }()
	var errs []error
	for range 4 {
		errs = append(errs, <-errc)
	}
	return errors.Join(errs...)
}

// allgather passes fixed-size messages down the ring n-1 times; out[r] is rank r's message.
func (r *ring) allgather(rank, n int, mine []byte) ([][]byte, error) {
	out := make([][]byte, n)
	out[rank] = mine
	carry := mine
	for step := 1; step < n; step++ {
		got := make([]byte, len(mine))
		errc := make(chan error, 2)
		go func() { _, err := r.down.Write(carry); errc <- err }()
		go func() { _, err := io.ReadFull(r.up, got); errc <- err }()
		if err := errors.Join(<-errc, <-errc); err != nil {
			return nil, fmt.Errorf("allgather step %d: %w", step, err)
		}
		out[(rank-step+n)%n] = got
		carry = got
	}
	return out, nil
}

func run(c config) (string, error) {
	n := len(c.addrs)
	row0, rows := rowsOf(c.rank, n, c.grid)
	g := c.grid
	rg, err := connect(c)
	if err != nil {
		return "", err
	}
	defer rg.close()

	// Double buffer (FT-SPMD's NDArray 1 and 2) with a halo row above and below the block.
	cur, next := make([]float64, (rows+2)*g), make([]float64, (rows+2)*g)
	for i := 0; i < rows; i++ {
		for j := 0; j < g; j++ {
			cur[(i+1)*g+j] = initial(row0+i, j)
		}
	}
	start := 0
	if c.restart {
		it, blk, err := resume(c, rg, row0, rows)
		if err != nil {
			return "", err
		}
		if blk != nil {
			copy(cur[g:(rows+1)*g], blk)
		}
		start = int(it)
		c.progress.Store(int64(start))
		fmt.Fprintf(c.stdout, "rank %d resumed from iteration %d at %d\n", c.rank, start, time.Now().UnixNano())
	}
	// Fixed columns: the next buffer carries them unchanged.
	copy(next, cur)

	toUp, toDown := make([]byte, g*8), make([]byte, g*8)
	fromUp, fromDown := make([]byte, g*8), make([]byte, g*8)
	for it := start; it < c.iters; it++ {
		putRow(toUp, cur[g:2*g])
		putRow(toDown, cur[rows*g:(rows+1)*g])
		if err := rg.halo(toUp, toDown, fromUp, fromDown); err != nil {
			return "", fmt.Errorf("iteration %d: halo exchange: %w", it, err)
		}
		getRow(cur[:g], fromUp)
		getRow(cur[(rows+1)*g:], fromDown)
		relax(next, cur, rows, g)
		cur, next = next, cur
		if c.delay > 0 {
			time.Sleep(c.delay)
		}
		done := it + 1
		c.progress.Store(int64(done))
		if done == c.reportAt {
			fmt.Fprintf(c.stdout, "rank %d reached iteration %d at %d\n", c.rank, done, time.Now().UnixNano())
		}
		if c.ckptEvery > 0 && done%c.ckptEvery == 0 && done < c.iters {
			if err := checkpointStep(c, rg, row0, rows, uint64(done), cur[g:(rows+1)*g]); err != nil {
				return "", err
			}
		}
	}

	for c.endAfter != "" {
		if _, err := os.Stat(c.endAfter); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}

	// Gather every rank's block hash; the checksum covers the whole grid.
	h := sha256.New()
	buf := make([]byte, g*8)
	for i := 1; i <= rows; i++ {
		putRow(buf, cur[i*g:(i+1)*g])
		h.Write(buf)
	}
	all, err := rg.allgather(c.rank, n, h.Sum(nil))
	if err != nil {
		return "", err
	}
	final := sha256.New()
	for _, s := range all {
		final.Write(s)
	}
	return hex.EncodeToString(final.Sum(nil)), nil
}

// relax is one Jacobi sweep of the block's rows (halos in rows 0 and rows+1 of cur).
func relax(next, cur []float64, rows, g int) {
	for i := 1; i <= rows; i++ {
		up, mid, dn, out := cur[(i-1)*g:i*g], cur[i*g:(i+1)*g], cur[(i+1)*g:(i+2)*g], next[i*g:(i+1)*g]
		for j := 1; j < g-1; j++ {
			out[j] = 0.25 * (up[j] + dn[j] + mid[j-1] + mid[j+1])
		}
	}
}

func putRow(b []byte, row []float64) {
	for j, v := range row {
		binary.LittleEndian.PutUint64(b[8*j:], math.Float64bits(v))
	}
}

func getRow(row []float64, b []byte) {
	for j := range row {
		row[j] = math.Float64frombits(binary.LittleEndian.Uint64(b[8*j:]))
	}
}

// checkpointStep writes this rank's checkpoint of iteration it, then agrees with all ranks (an allgather of
// "wrote it" flags) before deleting older files: until every rank has iteration it, the previous common
// checkpoint must survive.
func checkpointStep(c config, rg *ring, row0, rows int, it uint64, block []float64) error {
	n := len(c.addrs)
	ck := &checkpoint{Rank: c.rank, Ranks: n, Grid: c.grid, Row0: row0, Rows: rows, Iter: it, Block: block}
	ok := uint64(1)
	if _, err := writeCheckpoint(c.ckptDir, ck); err != nil {
		fmt.Fprintf(c.stderr, "stencil2d rank %d: checkpoint of iteration %d failed, keeping the previous one: %v\n", c.rank, it, err)
		ok = 0
	}
	all, err := rg.allgather(c.rank, n, binary.LittleEndian.AppendUint64(nil, ok))
	if err != nil {
		return fmt.Errorf("checkpoint agreement at iteration %d: %w", it, err)
	}
	for _, m := range all {
		if binary.LittleEndian.Uint64(m) != 1 {
			return nil // not complete everywhere: the older common checkpoint stays
		}
	}
	its, err := listCheckpoints(c.ckptDir, c.rank)
	if err != nil {
		return nil // deleting is housekeeping; a later checkpoint retries it
	}
	for _, old := range its {
		if old < it {
			os.Remove(filepath.Join(c.ckptDir, ckptName(c.rank, old)))
		}
	}
	return nil
}

// maxOffered bounds how many of its checkpoints a rank offers at restart (it normally holds one or two).
const maxOffered = 8

// resume finds the recovery line: each rank offers the iterations of its checkpoints that verify, the
// ranks gather the offers around the ring, and all pick the newest iteration every rank offered. Files
// newer than that line are deleted (some ranks wrote them, not all). A nil block means iteration 0.
func resume(c config, rg *ring, row0, rows int) (uint64, []float64, error) {
	n := len(c.addrs)
	its, err := listCheckpoints(c.ckptDir, c.rank)
	if err != nil {
		return 0, nil, err
	}
	valid := map[uint64]*checkpoint{}
	var offer []uint64
	for _, it := range its {
		if len(offer) == maxOffered {
			break
		}
		ck, err := loadCheckpoint(c.ckptDir, c.rank, n, c.grid, row0, rows, it)
		if err != nil {
			fmt.Fprintf(c.stderr, "stencil2d rank %d: ignoring checkpoint of iteration %d: %v\n", c.rank, it, err)
			continue
		}
		valid[it] = ck
		offer = append(offer, it)
	}
	msg := binary.LittleEndian.AppendUint64(nil, uint64(len(offer)))
	for i := range maxOffered {
		var v uint64
		if i < len(offer) {
			v = offer[i]
		}
		msg = binary.LittleEndian.AppendUint64(msg, v)
	}
	all, err := rg.allgather(c.rank, n, msg)
	if err != nil {
		return 0, nil, fmt.Errorf("agree on the recovery line: %w", err)
	}
	perRank := make([][]uint64, n)
	for r, m := range all {
		k := min(int(binary.LittleEndian.Uint64(m)), maxOffered)
		for i := range k {
			perRank[r] = append(perRank[r], binary.LittleEndian.Uint64(m[8+8*i:]))
		}
	}
	line := commonIteration(perRank)
	for _, it := range its {
		if it > line {
			os.Remove(filepath.Join(c.ckptDir, ckptName(c.rank, it)))
		}
	}
	if line == 0 {
		if len(its) > 0 {
			fmt.Fprintf(c.stderr, "stencil2d rank %d: no checkpoint common to all ranks; starting from the initial state\n", c.rank)
		}
		return 0, nil, nil
	}
	if int(line) > c.iters {
		return 0, nil, fmt.Errorf("the common checkpoint is of iteration %d, beyond --iters %d", line, c.iters)
	}
	return line, valid[line].Block, nil
}

func dialRetry(addr string, timeout time.Duration) (net.Conn, error) {
	deadline := time.Now().Add(timeout)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			return c, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("connect to the down neighbour %s: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
