package ckpt

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"
)

func validManifest() *Manifest {
	return &Manifest{
		Job: "job", Node: "node1", ID: "20261122T153000.123Z-node1-000002",
		Created: time.Date(2026, 11, 22, 15, 30, 0, 123_000_000, time.UTC),
		Parent:  "20261122T152000.000Z-node1-000001",
		Info:    testInfo(),
		Files: []FileEntry{
			{Name: "a/b.img", Size: 1, SHA256: strings.Repeat("ab", 32)},
			{Name: "pages-1.img", Size: 4096, SHA256: strings.Repeat("0f", 32)},
		},
		Replicas: []string{"node2"},
	}
}

func TestManifestRoundTrip(t *testing.T) {
	m := validManifest()
	b, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeManifest(b)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := got.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, b2) {
		t.Errorf("re-encoding differs:\n%s\n%s", b, b2)
	}
	if got.Conns[0].Remote != netip.MustParseAddrPort("[fd00::2]:5000") || !got.Created.Equal(m.Created) {
		t.Errorf("decoded %+v", got)
	}
}

func TestManifestRejects(t *testing.T) {
	tests := []struct {
		name   string
		change func(m *Manifest)
	}{
		{"traversal", func(m *Manifest) { m.Files[0].Name = "../etc/passwd" }},
		{"absolute", func(m *Manifest) { m.Files[0].Name = "/etc/passwd" }},
		{"dot component", func(m *Manifest) { m.Files[0].Name = "a/./b.img" }},
		{"empty component", func(m *Manifest) { m.Files[0].Name = "a//b.img" }},
		{"hidden", func(m *Manifest) { m.Files[0].Name = ".tmp-x" }},
		{"manifest name", func(m *Manifest) { m.Files[1].Name = ManifestName }},
		{"nul byte", func(m *Manifest) { m.Files[0].Name = "a\x00b" }},
		{"backslash", func(m *Manifest) { m.Files[0].Name = `a\b` }},
		{"file is also a dir", func(m *Manifest) { m.Files[0].Name = "a"; m.Files[1].Name = "a/x" }},
		{"file is also a dir, unsorted neighbour", func(m *Manifest) {
			m.Files = []FileEntry{{Name: "a", SHA256: strings.Repeat("00", 32)}, {Name: "a-b", SHA256: strings.Repeat("00", 32)}, {Name: "a/c", SHA256: strings.Repeat("00", 32)}}
		}},
		{"unsorted files", func(m *Manifest) { m.Files[0], m.Files[1] = m.Files[1], m.Files[0] }},
		{"duplicate files", func(m *Manifest) { m.Files[1] = m.Files[0] }},
		{"short sha", func(m *Manifest) { m.Files[0].SHA256 = "abcd" }},
		{"upper-case sha", func(m *Manifest) { m.Files[0].SHA256 = strings.Repeat("AB", 32) }},
		{"negative size", func(m *Manifest) { m.Files[0].Size = -1 }},
		// Two sizes of 2^62 wrapped TotalSize to -2^63, under any receiver's bound (a peer could then fill the
		// store with a few MB of compressed zeros).
		{"sizes overflow", func(m *Manifest) { m.Files[0].Size = 1 << 62; m.Files[1].Size = 1 << 62 }},
		{"bad mode", func(m *Manifest) { m.Mode = "coordinated" }},
		{"id node mismatch", func(m *Manifest) { m.Node = "node9" }},
		{"parent newer", func(m *Manifest) { m.Parent = "20991122T152000.000Z-node1-000001" }},
		{"bad job", func(m *Manifest) { m.Job = "../x" }},
		{"conn without address", func(m *Manifest) { m.Conns[0].Remote = netip.AddrPort{} }},
		{"replicas unsorted", func(m *Manifest) { m.Replicas = []string{"b", "a"} }},
		{"no created time", func(m *Manifest) { m.Created = time.Time{} }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := validManifest()
			tc.change(m)
			if err := m.Validate(); !errors.Is(err, ErrManifestInvalid) {
				t.Errorf("Validate = %v, want ErrManifestInvalid", err)
			}
			if _, err := m.Encode(); err == nil {
				t.Error("Encode wrote an invalid manifest")
			}
		})
	}
}

func TestDecodeManifestRejects(t *testing.T) {
	good, err := validManifest().Encode()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "invalid"},
		{"not json", []byte("CRIU"), "invalid"},
		{"other version", bytes.Replace(good, []byte(`"version": 1`), []byte(`"version": 2`), 1), "version 2"},
		{"other format", bytes.Replace(good, []byte(`ftkit-snapshot-manifest`), []byte(`something-else`), 1), "format"},
		{"checksum", bytes.Replace(good, []byte(`"node1"`), []byte(`"nodeX"`), 1), "checksum"},
		{"trailing data", append(append([]byte{}, good...), []byte("{}")...), "trailing"},
		{"too big", make([]byte, MaxManifestBytes+1), "limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DecodeManifest(tc.data)
			if !errors.Is(err, ErrManifestInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("DecodeManifest = %v, want ErrManifestInvalid mentioning %q", err, tc.want)
			}
		})
	}
}

func FuzzDecodeManifest(f *testing.F) {
	good, err := validManifest().Encode()
	if err != nil {
		f.Fatal(err)
	}
	body, err := json.Marshal(validManifest())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(body)
	f.Add([]byte(`{"format":"ftkit-snapshot-manifest","version":1,"sha256":"","manifest":{}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		check(t, data)
		// Also treat the input as the inner manifest with a correct checksum,
		// so the fuzzer reaches the schema checks behind the checksum gate.
		var compact bytes.Buffer
		if json.Compact(&compact, data) != nil {
			return
		}
		sum := sha256.Sum256(compact.Bytes())
		wrapped, err := json.Marshal(envelope{Format: manifestFormat, Version: ManifestVersion,
			SHA256: hex.EncodeToString(sum[:]), Manifest: compact.Bytes()})
		if err != nil {
			return
		}
		check(t, wrapped)
	})
}

func check(t *testing.T, data []byte) {
	{
		m, err := DecodeManifest(data)
		if err != nil {
			if !errors.Is(err, ErrManifestInvalid) {
				t.Fatalf("error %v does not wrap ErrManifestInvalid", err)
			}
			return
		}
		// Anything accepted is valid, re-encodes, and re-encoding is stable.
		for _, fe := range m.Files {
			if ValidFileName(fe.Name) != nil {
				t.Fatalf("accepted unsafe file name %q", fe.Name)
			}
		}
		if m.TotalSize() < 0 {
			t.Fatalf("accepted files whose sizes add up to %d", m.TotalSize())
		}
		b1, err := m.Encode()
		if err != nil {
			t.Fatalf("accepted manifest does not re-encode: %v", err)
		}
		m2, err := DecodeManifest(b1)
		if err != nil {
			t.Fatalf("re-encoded manifest does not decode: %v", err)
		}
		b2, err := m2.Encode()
		if err != nil || !bytes.Equal(b1, b2) {
			t.Fatalf("encoding not stable: %v", err)
		}
	}
}
