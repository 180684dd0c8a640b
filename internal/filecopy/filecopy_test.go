package filecopy

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
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
			err := PrefixToNew(dst, strings.NewReader(tc.src), tc.n)
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
	if err := PrefixToNew(filepath.Join(dir, "out"), strings.NewReader("x"), 1); err == nil {
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
