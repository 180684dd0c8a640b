package ckpt

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/tcpflow"
)

func testInfo() Info {
	return Info{
		CRIUVersion:   "4.2.1",
		KernelRelease: "6.18.0-test",
		Mode:          ModeUncoordinated,
		DumpDuration:  1500 * time.Millisecond,
		Stats: DumpStats{FreezingTime: 3 * time.Millisecond, FrozenTime: 800 * time.Millisecond,
			MemdumpTime: 400 * time.Millisecond, MemwriteTime: 350 * time.Millisecond, PagesScanned: 9000, PagesWritten: 4096},
		Conns: []Conn{{
			Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.MustParseAddrPort("[fd00::2]:5000")},
			Inode: 123456, InqSeq: 4294967000, InqLen: 10, OutqSeq: 7, OutqLen: 3, Timestamp: 991,
		}},
		OpenFiles: []OpenFile{{Path: "/var/log/job.out", Size: 4242}},
	}
}

func openStore(t *testing.T, root, node string) *Store {
	t.Helper()
	s, err := Open(root, Options{Node: node})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return s
}

// dumpFiles is what a small CRIU dump might contain.
func dumpFiles() map[string][]byte {
	pages := make([]byte, 64<<10)
	for i := range pages {
		pages[i] = byte(i * 7)
	}
	return map[string][]byte{
		"pages-1.img":           pages,
		"pagemap-1.img":         []byte("pagemap"),
		"tcp-stream-123456.img": []byte("tcp stream with queues"),
		"inventory.img":         {},
		"extra/out.txt":         []byte("job output copy"),
	}
}

func writeFiles(t *testing.T, dir string, files map[string][]byte) {
	t.Helper()
	for name, data := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func snapshot(t *testing.T, s *Store, job string, files map[string][]byte) *Manifest {
	t.Helper()
	p, err := s.Begin(job)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	writeFiles(t, p.Dir(), files)
	m, err := p.Commit(context.Background(), testInfo())
	if err != nil {
		t.Fatalf("Commit: %v", err)
	}
	return m
}

func hiddenEntries(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			out = append(out, e.Name())
		}
	}
	return out
}

func TestCommitListVerify(t *testing.T) {
	s := openStore(t, t.TempDir(), "node1")
	files := dumpFiles()
	p, err := s.Begin("lu")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(filepath.Base(p.Dir()), ".tmp-") {
		t.Errorf("pending dir %s is not hidden", p.Dir())
	}
	writeFiles(t, p.Dir(), files)
	m, err := p.Commit(context.Background(), testInfo())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p.Dir()); !os.IsNotExist(err) {
		t.Errorf("temp dir still present after commit: %v", err)
	}
	if got := hiddenEntries(t, filepath.Join(s.Root(), "lu")); len(got) != 0 {
		t.Errorf("hidden leftovers %v", got)
	}
	if len(m.Files) != len(files) {
		t.Fatalf("manifest has %d files, want %d", len(m.Files), len(files))
	}
	for _, f := range m.Files {
		sum := sha256.Sum256(files[f.Name])
		if f.SHA256 != hex.EncodeToString(sum[:]) || f.Size != int64(len(files[f.Name])) {
			t.Errorf("file %s: manifest %+v does not match content", f.Name, f)
		}
	}
	if m.Node != "node1" || m.Job != "lu" || m.Parent != "" || m.Mode != ModeUncoordinated {
		t.Errorf("manifest header %+v", m)
	}
	if m.TotalSize() != int64(64<<10+7+22+0+15) {
		t.Errorf("TotalSize %d", m.TotalSize())
	}

	m2 := snapshot(t, s, "lu", files)
	if m2.Parent != m.ID {
		t.Errorf("second snapshot parent %q, want %q", m2.Parent, m.ID)
	}
	ids, err := s.List("lu", "")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(ids, []string{m2.ID, m.ID}) {
		t.Errorf("List = %v, want newest first [%s %s]", ids, m2.ID, m.ID)
	}
	latest, err := s.Latest("lu", "node1")
	if err != nil || latest.ID != m2.ID {
		t.Errorf("Latest = %v, %v", latest, err)
	}
	got, err := s.Verify(context.Background(), "lu", m.ID)
	if err != nil {
		t.Fatalf("Verify: %v", err)
	}
	if got.Conns[0] != testInfo().Conns[0] || got.Stats != testInfo().Stats || got.OpenFiles[0] != testInfo().OpenFiles[0] {
		t.Errorf("manifest round trip lost data: %+v", got.Info)
	}
	if other, _ := s.List("lu", "node2"); len(other) != 0 {
		t.Errorf("List for another node = %v", other)
	}
	if _, err := s.Latest("nojob", ""); !errors.Is(err, ErrNotFound) {
		t.Errorf("Latest of unknown job: %v", err)
	}
}

func TestVerifyDetectsDamage(t *testing.T) {
	tests := []struct {
		name     string
		damage   func(t *testing.T, dir string)
		wantFile string
		wantErr  error
	}{
		{"corrupted byte", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "pages-1.img")
			b, _ := os.ReadFile(p)
			b[1000] ^= 0x01
			os.WriteFile(p, b, 0o644)
		}, "pages-1.img", ErrCorrupt},
		{"truncated file", func(t *testing.T, dir string) {
			os.Truncate(filepath.Join(dir, "pages-1.img"), 4096)
		}, "pages-1.img", ErrTruncated},
		{"grown file", func(t *testing.T, dir string) {
			f, _ := os.OpenFile(filepath.Join(dir, "pagemap-1.img"), os.O_APPEND|os.O_WRONLY, 0)
			f.Write([]byte("x"))
			f.Close()
		}, "pagemap-1.img", ErrCorrupt},
		{"missing file", func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, "extra/out.txt"))
		}, "extra/out.txt", ErrMissing},
		{"extra file", func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, "core-99.img"), []byte("sneaky"), 0o644)
		}, "core-99.img", ErrExtra},
		{"extra directory", func(t *testing.T, dir string) {
			os.Mkdir(filepath.Join(dir, "junk"), 0o755)
		}, "junk", ErrExtra},
		{"file replaced by symlink", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "pagemap-1.img")
			os.Remove(p)
			os.Symlink("/etc/passwd", p)
		}, "pagemap-1.img", ErrCorrupt},
		{"missing manifest", func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, ManifestName))
		}, ManifestName, ErrMissing},
		{"manifest byte flipped", func(t *testing.T, dir string) {
			p := filepath.Join(dir, ManifestName)
			b, _ := os.ReadFile(p)
			// Change a digit of the inq_seq: still valid JSON, wrong checksum.
			i := bytes.Index(b, []byte("4294967000"))
			if i < 0 {
				t.Fatal("inq_seq not found in manifest")
			}
			b[i+9] = '1'
			os.WriteFile(p, b, 0o644)
		}, ManifestName, ErrManifestInvalid},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t, t.TempDir(), "node1")
			m := snapshot(t, s, "job", dumpFiles())
			tc.damage(t, s.Path("job", m.ID))
			_, err := s.Verify(context.Background(), "job", m.ID)
			if err == nil {
				t.Fatal("Verify accepted a damaged snapshot")
			}
			if !errors.Is(err, tc.wantErr) {
				t.Errorf("error %v is not %v", err, tc.wantErr)
			}
			var ve *VerifyError
			if !errors.As(err, &ve) || ve.File != tc.wantFile {
				t.Errorf("error %v does not name file %s", err, tc.wantFile)
			}
			if !strings.Contains(err.Error(), tc.wantFile) {
				t.Errorf("message %q lacks file name", err)
			}
		})
	}
}

func TestLatestVerifiedSkipsDamaged(t *testing.T) {
	s := openStore(t, t.TempDir(), "node1")
	m1 := snapshot(t, s, "job", dumpFiles())
	m2 := snapshot(t, s, "job", dumpFiles())
	m3 := snapshot(t, s, "job", dumpFiles())
	os.Truncate(filepath.Join(s.Path("job", m3.ID), "pages-1.img"), 10)
	os.Remove(filepath.Join(s.Path("job", m2.ID), ManifestName))

	got, skipped, err := s.LatestVerified(context.Background(), "job", "node1")
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != m1.ID {
		t.Errorf("LatestVerified = %s, want the oldest intact %s", got.ID, m1.ID)
	}
	if len(skipped) != 2 || !errors.Is(skipped[0], ErrTruncated) || !errors.Is(skipped[1], ErrMissing) {
		t.Errorf("skipped = %v", skipped)
	}
	os.Remove(filepath.Join(s.Path("job", m1.ID), "inventory.img"))
	if _, skipped, err := s.LatestVerified(context.Background(), "job", ""); !errors.Is(err, ErrNotFound) || len(skipped) != 3 {
		t.Errorf("with nothing intact: err %v, skipped %d", err, len(skipped))
	}
}

func TestCrashDuringCommit(t *testing.T) {
	for _, step := range []string{"files-synced", "manifest-written", "before-rename", "after-rename"} {
		t.Run(step, func(t *testing.T) {
			root := t.TempDir()
			s := openStore(t, root, "node1")
			s.crashAt = func(at string) bool { return at == step }
			p, err := s.Begin("job")
			if err != nil {
				t.Fatal(err)
			}
			writeFiles(t, p.Dir(), dumpFiles())
			if _, err := p.Commit(context.Background(), testInfo()); !errors.Is(err, errSimulatedCrash) {
				t.Fatalf("Commit: %v, want simulated crash", err)
			}
			visibleAfterCrash := step == "after-rename"
			ids, _ := s.List("job", "")
			if (len(ids) == 1) != visibleAfterCrash || len(ids) > 1 {
				t.Fatalf("after crash at %s List = %v", step, ids)
			}
			if !visibleAfterCrash {
				if _, err := os.Stat(p.Dir()); err != nil {
					t.Fatalf("crash should have left the temp dir behind: %v", err)
				}
			}
			// "Restart": a new store on the same root cleans up.
			s2 := openStore(t, root, "node1")
			if got := hiddenEntries(t, filepath.Join(root, "job")); len(got) != 0 {
				t.Errorf("leftovers after reopen: %v", got)
			}
			ids, _ = s2.List("job", "")
			if visibleAfterCrash {
				if len(ids) != 1 {
					t.Fatalf("List = %v", ids)
				}
				if _, err := s2.Verify(context.Background(), "job", ids[0]); err != nil {
					t.Errorf("snapshot renamed before the crash does not verify: %v", err)
				}
			} else if len(ids) != 0 {
				t.Errorf("half snapshot visible after reopen: %v", ids)
			}
			// The store keeps working and does not reuse the crashed id's slot badly.
			m := snapshot(t, s2, "job", dumpFiles())
			if _, err := s2.Verify(context.Background(), "job", m.ID); err != nil {
				t.Error(err)
			}
		})
	}
}

func TestOpenKeepsLiveTempDir(t *testing.T) {
	root := t.TempDir()
	s := openStore(t, root, "node1")
	p, err := s.Begin("job")
	if err != nil {
		t.Fatal(err)
	}
	writeFiles(t, p.Dir(), dumpFiles())
	// A second store (e.g. another process) must not collect a live dump.
	openStore(t, root, "node1")
	if _, err := os.Stat(p.Dir()); err != nil {
		t.Fatalf("Open removed a temp dir that a writer holds: %v", err)
	}
	if _, err := p.Commit(context.Background(), testInfo()); err != nil {
		t.Fatal(err)
	}
}

func TestCommitRejectsUnstorableFiles(t *testing.T) {
	tests := []struct {
		name  string
		setup func(dir string) error
	}{
		{"symlink", func(dir string) error { return os.Symlink("/etc/hostname", filepath.Join(dir, "link.img")) }},
		{"manifest name", func(dir string) error { return os.WriteFile(filepath.Join(dir, ManifestName), nil, 0o644) }},
		{"hidden file", func(dir string) error { return os.WriteFile(filepath.Join(dir, ".hidden"), nil, 0o644) }},
		{"space in name", func(dir string) error { return os.WriteFile(filepath.Join(dir, "a b"), nil, 0o644) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t, t.TempDir(), "node1")
			p, err := s.Begin("job")
			if err != nil {
				t.Fatal(err)
			}
			writeFiles(t, p.Dir(), map[string][]byte{"pages-1.img": []byte("x")})
			if err := tc.setup(p.Dir()); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Commit(context.Background(), testInfo()); err == nil {
				t.Fatal("Commit accepted it")
			}
			if ids, _ := s.List("job", ""); len(ids) != 0 {
				t.Errorf("visible after failed commit: %v", ids)
			}
			if got := hiddenEntries(t, filepath.Join(s.Root(), "job")); len(got) != 0 {
				t.Errorf("failed commit left %v", got)
			}
		})
	}
}

func TestCommitHonoursContext(t *testing.T) {
	s := openStore(t, t.TempDir(), "node1")
	p, _ := s.Begin("job")
	writeFiles(t, p.Dir(), dumpFiles())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := p.Commit(ctx, testInfo()); !errors.Is(err, context.Canceled) {
		t.Errorf("Commit with cancelled context: %v", err)
	}
	if ids, _ := s.List("job", ""); len(ids) != 0 {
		t.Errorf("visible after cancelled commit: %v", ids)
	}
}

func TestAddReplica(t *testing.T) {
	s := openStore(t, t.TempDir(), "node1")
	m := snapshot(t, s, "job", dumpFiles())
	if _, err := s.AddReplica("job", m.ID, "node3"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AddReplica("job", m.ID, "node2"); err != nil {
		t.Fatal(err)
	}
	got, err := s.AddReplica("job", m.ID, "node3")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.Replicas, []string{"node2", "node3"}) {
		t.Errorf("replicas %v", got.Replicas)
	}
	if _, err := s.AddReplica("job", m.ID, "node1"); err == nil {
		t.Error("recorded the store's own node as a replica")
	}
	if _, err := s.AddReplica("job", "20260101T000000.000Z-node1-000001", "node2"); !errors.Is(err, ErrNotFound) {
		t.Errorf("AddReplica to unknown snapshot: %v", err)
	}
	v, err := s.Verify(context.Background(), "job", m.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !v.Replicated() || !slices.Equal(v.Replicas, []string{"node2", "node3"}) {
		t.Errorf("replicas not durable: %v", v.Replicas)
	}
	if _, err := os.Stat(filepath.Join(s.Path("job", m.ID), manifestTmp)); !os.IsNotExist(err) {
		t.Errorf("staging manifest left behind: %v", err)
	}
}

func TestPrune(t *testing.T) {
	// Snapshots are listed newest first; replicated[i] marks the i-th newest.
	tests := []struct {
		name        string
		replicated  []bool
		keep        int
		wantDeleted []int // indexes, newest = 0
		pinned      []int // indexes of pinned snapshots (a run's coordinated snapshot)
	}{
		{"none replicated keeps all", []bool{false, false, false, false, false}, 2, nil, nil},
		{"newest replicated", []bool{true, false, false, false, false}, 2, []int{2, 3, 4}, nil},
		{"only an old one replicated", []bool{false, false, true, false, false}, 1, []int{3, 4}, nil},
		{"replicated one beyond keep is itself kept", []bool{false, true, false}, 1, []int{2}, nil},
		{"fewer than keep", []bool{true, true}, 3, nil, nil},
		{"keep one, all replicated", []bool{true, true, true}, 1, []int{1, 2}, nil},
		{"a pinned one is kept", []bool{true, true, true, true}, 1, []int{1, 3}, []int{2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := openStore(t, t.TempDir(), "node1")
			n := len(tc.replicated)
			ids := make([]string, n)
			for i := n - 1; i >= 0; i-- { // oldest first
				m := snapshot(t, s, "job", map[string][]byte{"a.img": {byte(i)}})
				ids[i] = m.ID
				if tc.replicated[i] {
					if _, err := s.AddReplica("job", m.ID, "node2"); err != nil {
						t.Fatal(err)
					}
				}
			}
			var pinned []string
			for _, i := range tc.pinned {
				pinned = append(pinned, ids[i])
			}
			deleted, err := s.Prune(context.Background(), "job", tc.keep, pinned...)
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			for _, i := range tc.wantDeleted {
				want = append(want, ids[i])
			}
			if !slices.Equal(deleted, want) {
				t.Errorf("deleted %v, want %v", deleted, want)
			}
			left, _ := s.List("job", "")
			if len(left) != n-len(want) {
				t.Errorf("%d left, want %d", len(left), n-len(want))
			}
			if got := hiddenEntries(t, filepath.Join(s.Root(), "job")); len(got) != 0 {
				t.Errorf("prune left %v", got)
			}
		})
	}
}

func TestPruneIsPerNode(t *testing.T) {
	root := t.TempDir()
	prot := openStore(t, root, "prot")
	origin := openStore(t, t.TempDir(), "node1")
	// The protector holds its own unreplicated snapshots and three received
	// from node1 (received ones count node1 as a replica).
	own := []string{snapshot(t, prot, "job", dumpFiles()).ID, snapshot(t, prot, "job", dumpFiles()).ID}
	var recv []string
	for range 3 {
		m := snapshot(t, origin, "job", dumpFiles())
		receiveByCopy(t, origin, prot, m)
		recv = append(recv, m.ID)
	}
	deleted, err := prot.Prune(context.Background(), "job", 1)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(deleted, []string{recv[1], recv[0]}) {
		t.Errorf("deleted %v, want the two older received %v", deleted, recv[:2])
	}
	if left, _ := prot.List("job", "prot"); !slices.Equal(left, []string{own[1], own[0]}) {
		t.Errorf("own snapshots %v, want both kept (none replicated)", left)
	}
}

// receiveByCopy moves a snapshot between stores through BeginReceive, as
// the shipping receiver does, without the network.
func receiveByCopy(t *testing.T, from, to *Store, m *Manifest) *Manifest {
	t.Helper()
	p, err := to.BeginReceive(m)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range m.Files {
		b, err := os.ReadFile(filepath.Join(from.Path(m.Job, m.ID), f.Name))
		if err != nil {
			t.Fatal(err)
		}
		writeFiles(t, p.Dir(), map[string][]byte{f.Name: b})
	}
	got, err := p.CommitReceived(context.Background(), from.Node())
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func TestCommitReceived(t *testing.T) {
	origin := openStore(t, t.TempDir(), "node1")
	prot := openStore(t, t.TempDir(), "node2")
	m := snapshot(t, origin, "job", dumpFiles())
	if _, err := origin.AddReplica("job", m.ID, "node3"); err != nil {
		t.Fatal(err)
	}
	m, _ = origin.Manifest("job", m.ID)
	got := receiveByCopy(t, origin, prot, m)
	if !slices.Equal(got.Replicas, []string{"node1"}) {
		t.Errorf("received replicas %v, want only the sender", got.Replicas)
	}
	if _, err := prot.Verify(context.Background(), "job", m.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := prot.BeginReceive(m); !errors.Is(err, ErrExists) {
		t.Errorf("second receive: %v, want ErrExists", err)
	}

	// A tampered copy is refused, names the file, and leaves nothing.
	other := openStore(t, t.TempDir(), "node4")
	p, err := other.BeginReceive(m)
	if err != nil {
		t.Fatal(err)
	}
	files := dumpFiles()
	files["pagemap-1.img"] = []byte("pagemaP")
	files["bonus.img"] = []byte("!")
	delete(files, "inventory.img")
	writeFiles(t, p.Dir(), files)
	_, err = p.CommitReceived(context.Background(), "node1")
	for _, want := range []struct {
		file string
		kind error
	}{{"pagemap-1.img", ErrCorrupt}, {"bonus.img", ErrExtra}, {"inventory.img", ErrMissing}} {
		if err == nil || !strings.Contains(err.Error(), want.file) || !errors.Is(err, want.kind) {
			t.Errorf("tampered receive error %v should name %s (%v)", err, want.file, want.kind)
		}
	}
	if ids, _ := other.List("job", ""); len(ids) != 0 {
		t.Errorf("tampered snapshot visible: %v", ids)
	}
}

// TestCommitReceivedTakesWrittenEntries: a file the receiver recorded as written and hashed (Written) is
// not read back: its entry is the one recorded, still checked against the manifest, and a file whose size
// on disk is not the one recorded is hashed from disk instead.
func TestCommitReceivedTakesWrittenEntries(t *testing.T) {
	origin := openStore(t, t.TempDir(), "node1")
	m := snapshot(t, origin, "job", dumpFiles())
	pages, _ := m.File("pages-1.img")

	// Recorded and right: committed without reading it back, and what is on disk verifies.
	prot := openStore(t, t.TempDir(), "node2")
	p, err := prot.BeginReceive(m)
	if err != nil {
		t.Fatal(err)
	}
	copyInto(t, origin, m, p)
	for _, f := range m.Files {
		p.Written(f.Name, f.Size, f.SHA256)
	}
	if _, err := p.CommitReceived(context.Background(), "node1"); err != nil {
		t.Fatal(err)
	}
	if _, err := prot.Verify(context.Background(), "job", m.ID); err != nil {
		t.Fatal(err)
	}

	// The recorded entry is what the commit takes: a wrong sum there (the file on disk is right) fails
	// the manifest check, which shows the file was not hashed again.
	prot = openStore(t, t.TempDir(), "node3")
	p, err = prot.BeginReceive(m)
	if err != nil {
		t.Fatal(err)
	}
	copyInto(t, origin, m, p)
	p.Written(pages.Name, pages.Size, strings.Repeat("0", 64))
	if _, err := p.CommitReceived(context.Background(), "node1"); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), pages.Name) {
		t.Errorf("commit with a wrong recorded sum: %v, want ErrCorrupt naming %s", err, pages.Name)
	}
	if ids, _ := prot.List("job", ""); len(ids) != 0 {
		t.Errorf("refused snapshot visible: %v", ids)
	}

	// A file that changed size after it was recorded is hashed from disk: appended to, it is refused.
	prot = openStore(t, t.TempDir(), "node4")
	p, err = prot.BeginReceive(m)
	if err != nil {
		t.Fatal(err)
	}
	copyInto(t, origin, m, p)
	p.Written(pages.Name, pages.Size, pages.SHA256)
	f, err := os.OpenFile(filepath.Join(p.Dir(), pages.Name), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("more"))
	f.Close()
	if _, err := p.CommitReceived(context.Background(), "node1"); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), pages.Name) {
		t.Errorf("commit of a file grown after it was recorded: %v, want ErrCorrupt naming %s", err, pages.Name)
	}
}

func TestIDsGrowWhenClockStepsBack(t *testing.T) {
	clock := time.Date(2026, 11, 22, 15, 30, 0, 123_000_000, time.UTC)
	root := t.TempDir()
	s, err := Open(root, Options{Node: "n-1.a", Now: func() time.Time { return clock }})
	if err != nil {
		t.Fatal(err)
	}
	m1 := snapshot(t, s, "job", dumpFiles())
	if m1.ID != "20261122T153000.123Z-n-1.a-000001" {
		t.Errorf("id %s", m1.ID)
	}
	clock = clock.Add(-time.Hour)
	m2 := snapshot(t, s, "job", dumpFiles())
	// A restarted store with the clock still behind.
	s2, _ := Open(root, Options{Node: "n-1.a", Now: func() time.Time { return clock }})
	m3 := snapshot(t, s2, "job", dumpFiles())
	if !(m1.ID < m2.ID && m2.ID < m3.ID) {
		t.Errorf("ids not increasing: %s %s %s", m1.ID, m2.ID, m3.ID)
	}
	if m3.Parent != m2.ID {
		t.Errorf("parent %s, want %s", m3.Parent, m2.ID)
	}
}

func TestParseID(t *testing.T) {
	good := SnapshotID{Time: time.Date(2026, 11, 22, 15, 30, 0, 123_000_000, time.UTC), Node: "node-7", Seq: 42}
	if got, err := ParseID(good.String()); err != nil || got != good {
		t.Errorf("round trip %s: %+v %v", good, got, err)
	}
	for _, bad := range []string{
		"",
		"20261122T153000.123Z-node-42",        // seq not 6 digits
		"20261122T153000.123Z--000042",        // empty node
		"20261122T153000Z-node-000042",        // no millis
		"20261122T153000.123Z-no/de-000042",   // slash in node
		"20261122T153000.123Z-node-+00042",    // sign
		"20261122T253000.123Z-node-000042",    // hour 25
		"20261122T153000.123Z-.hidden-000042", // hidden node
		"20261122T153000.123Z-node-000042-",   // trailing
	} {
		if _, err := ParseID(bad); err == nil {
			t.Errorf("ParseID(%q) accepted", bad)
		}
	}
}

// assertPrivate walks root and fails for any directory that is not 0700 or
// file that is not 0600: snapshots hold process memory.
func assertPrivate(t *testing.T, root string) {
	t.Helper()
	n := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		want := fs.FileMode(0o600)
		if d.IsDir() {
			want = 0o700
		}
		if info.Mode().Perm() != want {
			t.Errorf("%s has mode %v, want %v", path, info.Mode().Perm(), want)
		}
		n++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 3 {
		t.Fatalf("walked only %d entries under %s", n, root)
	}
}

func TestStoreIsPrivate(t *testing.T) {
	// The dumper and the writer of received files may use any mode (CRIU
	// images, say, or a umask of 0); writeFiles uses 0755 and 0644.
	old := unix.Umask(0)
	defer unix.Umask(old)
	root := filepath.Join(t.TempDir(), "a", "store")
	s := openStore(t, root, "node1")
	m := snapshot(t, s, "job", dumpFiles())
	if _, err := s.AddReplica("job", m.ID, "node2"); err != nil {
		t.Fatal(err)
	}
	assertPrivate(t, root)

	prot := openStore(t, filepath.Join(t.TempDir(), "prot"), "node2")
	receiveByCopy(t, s, prot, m)
	assertPrivate(t, prot.Root())
}

func TestOpenRestrictsOlderStore(t *testing.T) {
	root := t.TempDir()
	s := openStore(t, root, "node1")
	m1 := snapshot(t, s, "job", dumpFiles())
	m2 := snapshot(t, s, "other", dumpFiles())
	// What an older version left: 0755 directories and 0644 files.
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return os.Chmod(path, 0o755)
		}
		return os.Chmod(path, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
	// A link in a snapshot must not make Open chmod what it points to.
	outside := filepath.Join(t.TempDir(), "outside")
	if err := os.WriteFile(outside, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(s.Path("job", m1.ID), "link")); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, root, "node1")
	if err := os.Remove(filepath.Join(s.Path("job", m1.ID), "link")); err != nil {
		t.Fatal(err)
	}
	assertPrivate(t, root)
	if st, _ := os.Stat(outside); st.Mode().Perm() != 0o644 {
		t.Errorf("Open changed the mode of a link target outside the store to %v", st.Mode().Perm())
	}
	for _, m := range []*Manifest{m1, m2} {
		if _, err := s2.Verify(context.Background(), m.Job, m.ID); err != nil {
			t.Error(err)
		}
	}
}

// sameIDStores returns two stores of the same node and clock in different
// roots: their first snapshots get the same id with different content, as
// a sender's copy that differs from the one a receiver holds.
func sameIDStores(t *testing.T) (*Store, *Store) {
	t.Helper()
	clock := func() time.Time { return time.Date(2026, 11, 22, 15, 30, 0, 0, time.UTC) }
	a, err := Open(t.TempDir(), Options{Node: "node1", Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(t.TempDir(), Options{Node: "node1", Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	return a, b
}

func otherFiles() map[string][]byte {
	f := dumpFiles()
	f["pages-1.img"] = bytes.Repeat([]byte("other memory "), 1000)
	delete(f, "extra/out.txt")
	f["core-1.img"] = []byte("core")
	return f
}

// copyInto writes m's files from src into a pending directory.
func copyInto(t *testing.T, src *Store, m *Manifest, p *Pending) {
	t.Helper()
	for _, f := range m.Files {
		b, err := os.ReadFile(filepath.Join(src.Path(m.Job, m.ID), f.Name))
		if err != nil {
			t.Fatal(err)
		}
		writeFiles(t, p.Dir(), map[string][]byte{f.Name: b})
	}
}

// sameContent fails unless the snapshot in s has exactly the files of want.
func sameContent(t *testing.T, s *Store, id string, want map[string][]byte) {
	t.Helper()
	m, err := s.Verify(context.Background(), "job", id)
	if err != nil {
		t.Fatalf("copy does not verify: %v", err)
	}
	if len(m.Files) != len(want) {
		t.Fatalf("copy has %d files, want %d", len(m.Files), len(want))
	}
	for _, f := range m.Files {
		b, err := os.ReadFile(filepath.Join(s.Path("job", id), f.Name))
		if err != nil || !bytes.Equal(b, want[f.Name]) {
			t.Fatalf("file %s is not the expected content (%v)", f.Name, err)
		}
	}
}

func TestBeginReplace(t *testing.T) {
	a, b := sameIDStores(t)
	ma := snapshot(t, a, "job", dumpFiles())
	mb := snapshot(t, b, "job", otherFiles())
	if ma.ID != mb.ID || sameFileList(ma, mb) {
		t.Fatalf("setup: ids %s %s should be equal and files differ", ma.ID, mb.ID)
	}
	prot := openStore(t, t.TempDir(), "prot")
	receiveByCopy(t, a, prot, ma)
	if _, err := prot.BeginReceive(mb); !errors.Is(err, ErrExists) {
		t.Fatalf("BeginReceive over a committed copy: %v, want ErrExists", err)
	}

	// A replacement that does not verify is refused and the old copy stays.
	p, err := prot.BeginReplace(mb)
	if err != nil {
		t.Fatal(err)
	}
	bad := otherFiles()
	bad["core-1.img"] = []byte("core!")
	writeFiles(t, p.Dir(), bad)
	if _, err := p.CommitReceived(context.Background(), "node1"); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("tampered replacement: %v, want ErrCorrupt", err)
	}
	sameContent(t, prot, ma.ID, dumpFiles())
	if got := hiddenEntries(t, filepath.Join(prot.Root(), "job")); len(got) != 0 {
		t.Errorf("failed replacement left %v", got)
	}

	// One that verifies takes its place.
	p, err = prot.BeginReplace(mb)
	if err != nil {
		t.Fatal(err)
	}
	copyInto(t, b, mb, p)
	got, err := p.CommitReceived(context.Background(), "node1")
	if err != nil {
		t.Fatal(err)
	}
	if !sameFileList(got, mb) {
		t.Errorf("committed manifest is not the replacement's")
	}
	sameContent(t, prot, mb.ID, otherFiles())
	if got := hiddenEntries(t, filepath.Join(prot.Root(), "job")); len(got) != 0 {
		t.Errorf("replacement left %v", got)
	}
	assertPrivate(t, prot.Root())

	// Without a committed copy, BeginReplace is a plain receive.
	fresh := openStore(t, t.TempDir(), "prot")
	p, err = fresh.BeginReplace(mb)
	if err != nil {
		t.Fatal(err)
	}
	copyInto(t, b, mb, p)
	if _, err := p.CommitReceived(context.Background(), "node1"); err != nil {
		t.Fatal(err)
	}
	sameContent(t, fresh, mb.ID, otherFiles())
}

func sameFileList(a, b *Manifest) bool { return slices.Equal(a.Files, b.Files) }

func TestCrashDuringReplace(t *testing.T) {
	// Each step and whether the new copy is the visible one after a crash there.
	steps := []struct {
		step   string
		newWon bool
	}{
		{"files-synced", false},
		{"manifest-written", false},
		{"before-rename", false},
		{"after-exchange", true},
		{"exchange-synced", true},
		{"old-hidden", true},
	}
	for _, tc := range steps {
		t.Run(tc.step, func(t *testing.T) {
			a, b := sameIDStores(t)
			ma := snapshot(t, a, "job", dumpFiles())
			mb := snapshot(t, b, "job", otherFiles())
			root := t.TempDir()
			prot := openStore(t, root, "prot")
			receiveByCopy(t, a, prot, ma)

			prot.crashAt = func(at string) bool { return at == tc.step }
			p, err := prot.BeginReplace(mb)
			if err != nil {
				t.Fatal(err)
			}
			copyInto(t, b, mb, p)
			if _, err := p.CommitReceived(context.Background(), "node1"); !errors.Is(err, errSimulatedCrash) {
				t.Fatalf("CommitReceived: %v, want simulated crash", err)
			}
			want := dumpFiles()
			if tc.newWon {
				want = otherFiles()
			}
			// Right after the crash and after a restart's garbage collection,
			// exactly one complete copy is visible.
			for _, s := range []*Store{prot, openStore(t, root, "prot")} {
				ids, err := s.List("job", "")
				if err != nil || !slices.Equal(ids, []string{ma.ID}) {
					t.Fatalf("List = %v, %v; want the one id %s", ids, err, ma.ID)
				}
				sameContent(t, s, ma.ID, want)
			}
			if got := hiddenEntries(t, filepath.Join(root, "job")); len(got) != 0 {
				t.Errorf("leftovers after reopen: %v", got)
			}
			assertPrivate(t, root)
		})
	}
}

func TestPruneReceived(t *testing.T) {
	// Copies are listed newest first; indexes below count from the newest.
	tests := []struct {
		name        string
		n, keep     int
		fresh       int   // index of the copy just received, -1 for none
		damaged     []int // copies whose content was damaged after commit
		wantDeleted []int
	}{
		{"keeps the newest keep", 5, 2, 0, nil, []int{2, 3, 4}},
		{"fewer than keep", 2, 3, 0, nil, nil},
		{"fresh arrived out of order, newer intact", 4, 1, 2, nil, []int{1, 2, 3}},
		{"newest damaged, fresh behind it", 4, 1, 1, []int{0}, []int{2, 3}},
		{"newer ones damaged, no fresh", 3, 1, -1, []int{0, 1}, nil},
		{"newest damaged, no fresh", 4, 2, -1, []int{0}, []int{2, 3}},
		{"two newest damaged, keep one", 4, 1, -1, []int{0, 1}, []int{3}},
		{"nothing verifies", 3, 1, -1, []int{0, 1, 2}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			origin := openStore(t, t.TempDir(), "node1")
			prot := openStore(t, t.TempDir(), "prot")
			ids := make([]string, tc.n)
			for i := tc.n - 1; i >= 0; i-- {
				m := snapshot(t, origin, "job", dumpFiles())
				receiveByCopy(t, origin, prot, m)
				ids[i] = m.ID
			}
			for _, i := range tc.damaged {
				flipByte(t, filepath.Join(prot.Path("job", ids[i]), "pages-1.img"))
			}
			fresh := ""
			if tc.fresh >= 0 {
				fresh = ids[tc.fresh]
			}
			deleted, err := prot.PruneReceived(context.Background(), "job", "node1", tc.keep, fresh)
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			for _, i := range tc.wantDeleted {
				want = append(want, ids[i])
			}
			if !slices.Equal(deleted, want) {
				t.Errorf("deleted %v, want %v", deleted, want)
			}
			left, _ := prot.List("job", "node1")
			if len(left) != tc.n-len(want) {
				t.Errorf("%d left, want %d", len(left), tc.n-len(want))
			}
		})
	}
	s := openStore(t, t.TempDir(), "prot")
	if _, err := s.PruneReceived(context.Background(), "job", "prot", 1, ""); err == nil {
		t.Error("PruneReceived accepted this node's own snapshots")
	}
	if _, err := s.PruneReceived(context.Background(), "job", "node1", 0, ""); err == nil {
		t.Error("PruneReceived accepted keep 0")
	}
}

// flipByte damages a file without changing its size, which only hashing finds.
func flipByte(t *testing.T, path string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0x40
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// A protector's copies all name the sender as replica, which says nothing
// about them: Prune must not delete the last one that verifies because a
// newer copy, damaged since it arrived, is "replicated".
func TestPruneKeepsNewestVerifiedReceivedCopy(t *testing.T) {
	origin := openStore(t, t.TempDir(), "node1")
	prot := openStore(t, t.TempDir(), "prot")
	var ids []string
	for range 3 {
		m := snapshot(t, origin, "job", dumpFiles())
		receiveByCopy(t, origin, prot, m)
		ids = append(ids, m.ID)
	}
	flipByte(t, filepath.Join(prot.Path("job", ids[2]), "pages-1.img"))
	flipByte(t, filepath.Join(prot.Path("job", ids[1]), "pages-1.img"))
	if _, err := prot.Prune(context.Background(), "job", 1); err != nil {
		t.Fatal(err)
	}
	m, _, err := prot.LatestVerified(context.Background(), "job", "node1")
	if err != nil {
		t.Fatalf("the protector lost its last verified copy: %v", err)
	}
	if m.ID != ids[0] {
		t.Errorf("latest verified %s, want %s", m.ID, ids[0])
	}
}

// TestDeleteWithUnfinishedEarlierRemoval: a snapshot whose earlier removal
// stopped half-way (its hidden directory still holds files) is deleted again
// once it is back under its name (a replica received anew). The old code
// renamed it to the fixed name .del-<id> and failed with "file exists" until
// the agent restarted; Open removes the leftover either way.
func TestDeleteWithUnfinishedEarlierRemoval(t *testing.T) {
	root := t.TempDir()
	s := openStore(t, root, "node1")
	m := snapshot(t, s, "job", dumpFiles())
	jobDir := filepath.Join(root, "job")
	writeFiles(t, filepath.Join(jobDir, delPrefix+m.ID), map[string][]byte{"pages-1.img": []byte("left over")})
	if err := s.Delete("job", m.ID); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, err := s.Manifest("job", m.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("snapshot still there after Delete: %v", err)
	}
	openStore(t, root, "node1")
	if left := hiddenEntries(t, jobDir); len(left) != 0 {
		t.Errorf("Open left %v", left)
	}
}

// TestAddReplicaValidatesBeforeLocking: AddReplica checks the job and id
// before it opens and waits for a lock on the directory they name: the old
// code opened ../<name> outside the store and waited for as long as someone
// else held a lock on it.
func TestAddReplicaValidatesBeforeLocking(t *testing.T) {
	base := t.TempDir()
	s := openStore(t, filepath.Join(base, "store"), "node1")
	outside := filepath.Join(base, "outside")
	if err := os.Mkdir(outside, 0o700); err != nil {
		t.Fatal(err)
	}
	lk, err := lockDir(outside, false)
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Close()
	done := make(chan error, 1)
	go func() {
		_, err := s.AddReplica("..", "outside", "node2")
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("AddReplica accepted job \"..\"")
		}
	case <-time.After(30 * time.Second):
		lk.Close() // let the blocked call end
		<-done
		t.Fatal("AddReplica waited for a lock on a directory outside the store")
	}
}

// TestOpenFinishesInterruptedRestrict: a pass that restricted a snapshot
// directory of an older version, then stopped before its files, is finished
// by the next Open. The old code walked only directories not yet 0700, so
// the files stayed world-readable for good.
func TestOpenFinishesInterruptedRestrict(t *testing.T) {
	root := t.TempDir()
	s := openStore(t, root, "node1")
	m := snapshot(t, s, "job", dumpFiles())
	dir := s.Path("job", m.ID)
	for _, name := range []string{"pages-1.img", "extra/out.txt"} {
		if err := os.Chmod(filepath.Join(dir, filepath.FromSlash(name)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(dir, "extra"), 0o755); err != nil {
		t.Fatal(err)
	}
	openStore(t, root, "node1")
	assertPrivate(t, root)
}
