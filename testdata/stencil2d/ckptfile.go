package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
)

// Application-level checkpoint file, one per rank and checkpointed iteration (FT-SPMD style: only the
// registered data, here the rank's block of the read buffer and the iteration number; the write buffer
// and the halo rows are not saved because the next superstep recomputes them):
//
//	magic "S2DCKPT1" | version u32 | rank u32 | ranks u32 | grid u32 | row0 u32 | rows u32 | iter u64 |
//	rows*grid float64 (little endian, row-major) | SHA-256 of everything before it
const (
	ckptMagic   = "S2DCKPT1"
	ckptVersion = 1
	headerLen   = 8 + 4*6 + 8
	sumLen      = sha256.Size
	// maxCells bounds what a decoder will believe before checking the length (a 2^31-cell block is 16 GiB).
	maxCells = 1 << 31
)

var errCorrupt = errors.New("corrupt checkpoint")

// checkpoint is one rank's registered state at a superstep boundary.
type checkpoint struct {
	Rank, Ranks int
	Grid        int // the global grid is Grid x Grid
	Row0, Rows  int // this rank's rows [Row0, Row0+Rows)
	Iter        uint64
	Block       []float64 // Rows*Grid values
}

func (c *checkpoint) encode() []byte {
	b := make([]byte, 0, headerLen+len(c.Block)*8+sumLen)
	b = append(b, ckptMagic...)
	for _, v := range []int{ckptVersion, c.Rank, c.Ranks, c.Grid, c.Row0, c.Rows} {
		b = binary.LittleEndian.AppendUint32(b, uint32(v))
	}
	b = binary.LittleEndian.AppendUint64(b, c.Iter)
	for _, f := range c.Block {
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(f))
	}
	s := sha256.Sum256(b)
	return append(b, s[:]...)
}

// decodeCheckpoint parses and verifies a checkpoint file's bytes; anything inconsistent is errCorrupt.
func decodeCheckpoint(b []byte) (*checkpoint, error) {
	if len(b) < headerLen+sumLen {
		return nil, fmt.Errorf("%w: %d bytes, shorter than a header", errCorrupt, len(b))
	}
	if string(b[:8]) != ckptMagic {
		return nil, fmt.Errorf("%w: bad magic %q", errCorrupt, b[:8])
	}
	body, sum := b[:len(b)-sumLen], b[len(b)-sumLen:]
	if s := sha256.Sum256(body); !bytes.Equal(s[:], sum) {
		return nil, fmt.Errorf("%w: checksum mismatch", errCorrupt)
	}
	u := func(i int) int { return int(binary.LittleEndian.Uint32(b[8+4*i:])) }
	if v := u(0); v != ckptVersion {
		return nil, fmt.Errorf("%w: version %d, this program reads %d", errCorrupt, v, ckptVersion)
	}
	c := &checkpoint{Rank: u(1), Ranks: u(2), Grid: u(3), Row0: u(4), Rows: u(5), Iter: binary.LittleEndian.Uint64(b[32:])}
	if c.Ranks < 1 || c.Rank >= c.Ranks || c.Grid < 3 || c.Rows < 1 || c.Row0+c.Rows > c.Grid ||
		uint64(c.Rows)*uint64(c.Grid) > maxCells {
		return nil, fmt.Errorf("%w: inconsistent geometry rank %d/%d grid %d rows %d+%d", errCorrupt, c.Rank, c.Ranks, c.Grid, c.Row0, c.Rows)
	}
	cells := c.Rows * c.Grid
	if len(body)-headerLen != cells*8 {
		return nil, fmt.Errorf("%w: %d payload bytes for %d cells", errCorrupt, len(body)-headerLen, cells)
	}
	c.Block = make([]float64, cells)
	for i := range c.Block {
		c.Block[i] = math.Float64frombits(binary.LittleEndian.Uint64(body[headerLen+8*i:]))
	}
	return c, nil
}

func ckptName(rank int, iter uint64) string { return fmt.Sprintf("rank-%d-iter-%d.ckpt", rank, iter) }

var ckptNameRE = regexp.MustCompile(`^rank-(\d+)-iter-(\d+)\.ckpt$`)

// writeCheckpoint stores c durably: write to a temporary name, fsync, rename, fsync the directory, so that
// a crash leaves either the old set of files or the new one, never a torn file under the final name.
func writeCheckpoint(dir string, c *checkpoint) (int64, error) {
	final := filepath.Join(dir, ckptName(c.Rank, c.Iter))
	tmp := final + ".tmp"
	b := c.encode()
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return 0, fmt.Errorf("create checkpoint %s: %w", tmp, err)
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		os.Remove(tmp)
		return 0, fmt.Errorf("write checkpoint %s: %w", tmp, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(tmp)
		return 0, fmt.Errorf("fsync checkpoint %s: %w", tmp, err)
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return 0, err
	}
	if err := os.Rename(tmp, final); err != nil {
		os.Remove(tmp)
		return 0, fmt.Errorf("commit checkpoint %s: %w", final, err)
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return int64(len(b)), nil
}

// listCheckpoints returns the iterations for which rank has a file in dir (not yet verified), newest first.
func listCheckpoints(dir string, rank int) ([]uint64, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list checkpoints in %s: %w", dir, err)
	}
	var its []uint64
	for _, e := range ents {
		m := ckptNameRE.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		r, err1 := strconv.Atoi(m[1])
		it, err2 := strconv.ParseUint(m[2], 10, 64)
		if err1 != nil || err2 != nil || r != rank {
			continue
		}
		its = append(its, it)
	}
	sort.Slice(its, func(i, j int) bool { return its[i] > its[j] })
	return its, nil
}

// loadCheckpoint reads and verifies rank's checkpoint of iter and checks that it belongs to this run's
// geometry (a file from a run with another grid or rank count is refused, not silently mixed in).
func loadCheckpoint(dir string, rank, ranks, grid, row0, rows int, iter uint64) (*checkpoint, error) {
	p := filepath.Join(dir, ckptName(rank, iter))
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	c, err := decodeCheckpoint(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", p, err)
	}
	if c.Rank != rank || c.Ranks != ranks || c.Grid != grid || c.Row0 != row0 || c.Rows != rows || c.Iter != iter {
		return nil, fmt.Errorf("%s: %w: written by rank %d/%d grid %d rows %d+%d iteration %d, not this run's", p, errCorrupt,
			c.Rank, c.Ranks, c.Grid, c.Row0, c.Rows, c.Iter)
	}
	return c, nil
}

// commonIteration is the newest iteration every rank holds a valid checkpoint of (the recovery line), or
// 0 (the initial state, always a valid line) when there is none.
func commonIteration(perRank [][]uint64) uint64 {
	if len(perRank) == 0 {
		return 0
	}
	count := map[uint64]int{}
	for _, its := range perRank {
		seen := map[uint64]bool{}
		for _, it := range its {
			if !seen[it] {
				seen[it] = true
				count[it]++
			}
		}
	}
	var best uint64
	for it, n := range count {
		if n == len(perRank) && it > best {
			best = it
		}
	}
	return best
}
