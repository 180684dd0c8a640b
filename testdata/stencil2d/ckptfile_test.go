package main

import (
	"crypto/sha256"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func sampleCheckpoint() *checkpoint {
	c := &checkpoint{Rank: 1, Ranks: 3, Grid: 5, Row0: 1, Rows: 2, Iter: 40}
	for i := range c.Rows * c.Grid {
		c.Block = append(c.Block, float64(i)*0.125-1)
	}
	return c
}

func TestCheckpointRoundTrip(t *testing.T) {
	want := sampleCheckpoint()
	got, err := decodeCheckpoint(want.encode())
	if err != nil {
		t.Fatal(err)
	}
	if got.Rank != want.Rank || got.Ranks != want.Ranks || got.Grid != want.Grid || got.Row0 != want.Row0 ||
		got.Rows != want.Rows || got.Iter != want.Iter || len(got.Block) != len(want.Block) {
		t.Fatalf("decoded %+v, want %+v", got, want)
	}
	for i := range want.Block {
		if got.Block[i] != want.Block[i] {
			t.Fatalf("cell %d: %v, want %v", i, got.Block[i], want.Block[i])
		}
	}
}

func TestCheckpointCorruptRefused(t *testing.T) {
	good := sampleCheckpoint().encode()
	// reseal recomputes the trailing checksum, so that only the inconsistency under test is wrong.
	reseal := func(b []byte) []byte {
		body := clone(b[:len(b)-sumLen])
		s := sha256.Sum256(body)
		return append(body, s[:]...)
	}
	tests := []struct {
		name  string
		bytes func() []byte
	}{
		{"empty", func() []byte { return nil }},
		{"truncated header", func() []byte { return good[:20] }},
		{"truncated payload", func() []byte { return good[:len(good)-9] }},
		{"flipped payload bit", func() []byte { b := clone(good); b[headerLen+3] ^= 1; return b }},
		{"flipped checksum bit", func() []byte { b := clone(good); b[len(b)-1] ^= 0x80; return b }},
		{"bad magic", func() []byte { b := clone(good); b[0] = 'X'; return reseal(b) }},
		{"future version", func() []byte { b := clone(good); b[8] = 9; return reseal(b) }},
		{"rank beyond ranks", func() []byte { b := clone(good); b[12] = 7; return reseal(b) }},
		{"rows beyond grid", func() []byte { b := clone(good); b[28] = 200; return reseal(b) }},
		{"payload shorter than rows", func() []byte {
			b := clone(good[:len(good)-sumLen-8])
			return reseal(append(b, make([]byte, sumLen)...))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := decodeCheckpoint(tt.bytes()); !errors.Is(err, errCorrupt) {
				t.Fatalf("decode: err %v, want errCorrupt", err)
			}
		})
	}
}

func TestLoadCheckpointRefusesOtherRun(t *testing.T) {
	dir := t.TempDir()
	c := sampleCheckpoint()
	if _, err := writeCheckpoint(dir, c); err != nil {
		t.Fatal(err)
	}
	if _, err := loadCheckpoint(dir, c.Rank, c.Ranks, c.Grid, c.Row0, c.Rows, c.Iter); err != nil {
		t.Fatalf("own checkpoint: %v", err)
	}
	if _, err := loadCheckpoint(dir, c.Rank, c.Ranks, c.Grid+1, c.Row0, c.Rows, c.Iter); !errors.Is(err, errCorrupt) {
		t.Fatalf("other grid: err %v, want errCorrupt", err)
	}
	// A file renamed to another iteration is refused too: the name is not trusted over the content.
	if err := os.Rename(filepath.Join(dir, ckptName(1, 40)), filepath.Join(dir, ckptName(1, 60))); err != nil {
		t.Fatal(err)
	}
	if _, err := loadCheckpoint(dir, 1, 3, 5, 1, 2, 60); !errors.Is(err, errCorrupt) {
		t.Fatalf("renamed file: err %v, want errCorrupt", err)
	}
	if its, _ := listCheckpoints(dir, 1); len(its) != 1 || its[0] != 60 {
		t.Fatalf("listed %v", its)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("temporary files left behind: %v", ents)
	}
}

func TestCommonIteration(t *testing.T) {
	tests := []struct {
		name    string
		perRank [][]uint64
		want    uint64
	}{
		{"no ranks", nil, 0},
		{"nothing written", [][]uint64{nil, nil, nil}, 0},
		{"all agree", [][]uint64{{40}, {40}, {40}}, 40},
		{"crash before agreement", [][]uint64{{60, 40}, {40}, {60, 40}}, 40},
		{"one rank lost everything", [][]uint64{{60, 40}, {}, {60, 40}}, 0},
		{"duplicates count once", [][]uint64{{40, 40}, {20}}, 0},
		{"newest common wins", [][]uint64{{80, 60, 40}, {60, 40}, {80, 60}}, 60},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := commonIteration(tt.perRank); got != tt.want {
				t.Fatalf("commonIteration(%v) = %d, want %d", tt.perRank, got, tt.want)
			}
		})
	}
}

func TestRowsOfCoversGrid(t *testing.T) {
	for _, tc := range []struct{ ranks, grid int }{{2, 3}, {3, 10}, {4, 2048}, {7, 100}} {
		next := 0
		for r := range tc.ranks {
			row0, rows := rowsOf(r, tc.ranks, tc.grid)
			if row0 != next || rows < 1 {
				t.Fatalf("%d ranks, grid %d: rank %d owns %d+%d, want start %d and at least a row", tc.ranks, tc.grid, r, row0, rows, next)
			}
			next = row0 + rows
		}
		if next != tc.grid {
			t.Fatalf("%d ranks, grid %d: rows end at %d", tc.ranks, tc.grid, next)
		}
	}
}

func FuzzDecodeCheckpoint(f *testing.F) {
	f.Add(sampleCheckpoint().encode())
	f.Add([]byte(ckptMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := decodeCheckpoint(b)
		if err != nil {
			return
		}
		// Whatever decodes must re-encode to the same bytes.
		if got := c.encode(); string(got) != string(b) {
			t.Fatalf("re-encoding differs: %d bytes vs %d", len(got), len(b))
		}
	})
}

func clone(b []byte) []byte { return append([]byte(nil), b...) }
