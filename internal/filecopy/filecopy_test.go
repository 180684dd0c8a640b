package filecopy

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestPrefixToNew(t *testing.T) {
	tests := []struct {
		name    string
		src     string
		n       int64
		exists  bool   // dst is there before
		want    string // dst's content; "" with wantErr: no dst left
		wantErr bool
	}{
		{"prefix", "0123456789", 4, false, "0123", false},
		{"whole", "0123", 4, false, "0123", false},
		{"empty", "0123", 0, false, "", false},
		{"source shorter", "01", 4, false, "", true},
		{"destination exists", "0123", 2, true, "old", true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(t.TempDir(), "out")
			if tc.exists {
				if err := os.WriteFile(dst, []byte("old"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			err := PrefixToNew(dst, fileOf(t, tc.src), tc.n)
			if (err != nil) != tc.wantErr {
				t.Fatalf("PrefixToNew: %v, want error %v", err, tc.wantErr)
			}
			got, rerr := os.ReadFile(dst)
			switch {
			case tc.wantErr && !tc.exists:
				if rerr == nil {
					t.Errorf("a failed copy left %s (%q)", dst, got)
				}
			case string(got) != tc.want:
				t.Errorf("dst holds %q, want %q", got, tc.want)
			}
			if !tc.wantErr {
				if st, err := os.Stat(dst); err != nil || st.Mode().Perm() != 0o600 {
					t.Errorf("dst %v, %v; want mode 0600", st, err)
				}
			}
		})
	}
}

func TestPrefixToNewRefusesLink(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.Symlink(target, filepath.Join(dir, "out")); err != nil {
		t.Fatal(err)
	}
	if err := PrefixToNew(filepath.Join(dir, "out"), fileOf(t, "x"), 1); err == nil {
		t.Error("PrefixToNew wrote through a dangling link")
	}
	if _, err := os.Lstat(target); err == nil {
		t.Error("the link's target was created")
	}
}

func TestPrefixShortSource(t *testing.T) {
	var b bytes.Buffer
	err := Prefix(&b, strings.NewReader("ab"), 3)
	if !errors.Is(err, io.EOF) || !strings.Contains(err.Error(), "3 bytes") {
		t.Errorf("Prefix of a short source: %v; want io.EOF naming the size", err)
	}
}

// fileOf is an open file holding s.
func fileOf(t *testing.T, s string) *os.File {
	t.Helper()
	p := filepath.Join(t.TempDir(), "src")
	if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// A sparse source is copied as sparse: its data at the same offsets, its holes as holes (a job's output
// made sparse with a seek past its end was copied whole, every byte of root's disk, and so was the journal
// of a user's file truncated to 10 TB before a restore). Range takes a window of it the same way.
func TestSparseSource(t *testing.T) {
	const size = 4 << 30
	p := filepath.Join(t.TempDir(), "sparse")
	src, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	at := map[int64]string{0: "head", 1 << 30: "middle", size - 4: "tail"}
	for off, s := range at {
		if _, err := src.WriteAt([]byte(s), off); err != nil {
			t.Fatal(err)
		}
	}
	check := func(name string, off, n int64) {
		t.Helper()
		f, err := os.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var st syscall.Stat_t
		if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
			t.Fatal(err)
		}
		if st.Size != n || st.Blocks*512 > 1<<20 {
			t.Errorf("copy of [%d, %d): %d bytes, %d of them on disk; want %d, most of them holes", off, off+n, st.Size, st.Blocks*512, n)
		}
		for o, s := range at {
			if o < off || o+int64(len(s)) > off+n {
				continue
			}
			b := make([]byte, len(s))
			if _, err := f.ReadAt(b, o-off); err != nil || string(b) != s {
				t.Errorf("copy of [%d, %d) at %d: %q, %v; want %q", off, off+n, o-off, b, err, s)
			}
		}
	}
	dst := filepath.Join(t.TempDir(), "copy")
	if err := PrefixToNew(dst, src, size); err != nil {
		t.Fatal(err)
	}
	check(dst, 0, size)
	out, err := os.Create(filepath.Join(t.TempDir(), "window"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := Range(out, src, 1<<29, size-1<<29); err != nil {
		t.Fatal(err)
	}
	check(out.Name(), 1<<29, size-1<<29)
	if err := PrefixToNew(filepath.Join(t.TempDir(), "long"), src, size+1); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a copy past the source's end: %v, want io.ErrUnexpectedEOF", err)
	}
}

// A source truncated during the copy fails it: its bytes past the new end would otherwise come out as a
// hole, and the copy hold zeros where the recorded bytes were.
func TestRangeSourceTruncatedDuringCopy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		to     int64 // the source's size after the first piece of data is copied
		failed bool
	}{
		{"truncated into the hole", 4096, true},
		{"truncated to nothing", 0, true},
		{"not truncated", 1<<20 + 4096, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "src")
			src, err := os.Create(p)
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			for _, off := range []int64{0, 1 << 20} {
				if _, err := src.WriteAt(bytes.Repeat([]byte{'x'}, 4096), off); err != nil {
					t.Fatal(err)
				}
			}
			truncated := false
			afterData := func() {
				if !truncated {
					truncated = true
					if err := src.Truncate(tc.to); err != nil {
						t.Error(err)
					}
				}
			}
			out, err := os.Create(filepath.Join(t.TempDir(), "out"))
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			err = rangeTo(out, 0, src, 0, 1<<20+4096, afterData)
			if tc.failed != errors.Is(err, io.ErrUnexpectedEOF) {
				t.Errorf("Range of a source truncated to %d bytes during the copy: %v, want io.ErrUnexpectedEOF %v", tc.to, err, tc.failed)
			}
		})
	}
}
