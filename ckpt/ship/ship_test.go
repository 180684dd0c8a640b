package ship

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/tcpflow"
	"github.com/pierrec/lz4/v4"
	"golang.org/x/sys/unix"
)

// memoryPages returns n bytes that look like a process's memory: 4 KiB
// pages, ~40% zero, ~30% random (heap with compressed or encrypted data),
// ~30% text-like.
func memoryPages(n int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, 1))
	words := strings.Fields("the quick brown fox MPI_Send rank iteration residual 0.000123 matrix " +
		"halo exchange converged solver /usr/lib/x86_64-linux-gnu/libc.so.6 LD_LIBRARY_PATH=/opt/lib " +
		"error warning info timestamp=1763820000 node-17 tcp 10.0.0.17:40000")
	out := make([]byte, n)
	for off := 0; off < n; off += 4096 {
		page := out[off:min(off+4096, n)]
		switch r := rng.IntN(10); {
		case r < 4: // zero page
		case r < 7:
			for i := range page {
				page[i] = byte(rng.Uint32())
			}
		default:
			var b bytes.Buffer
			for b.Len() < len(page) {
				b.WriteString(words[rng.IntN(len(words))])
				b.WriteByte(' ')
			}
			copy(page, b.Bytes())
		}
	}
	return out
}

func testInfo() ckpt.Info {
	return ckpt.Info{
		CRIUVersion: "4.2.1", KernelRelease: "6.18.0", Mode: ckpt.ModeUncoordinated,
		Conns: []ckpt.Conn{{
			Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.MustParseAddrPort("10.0.0.2:5000")},
			Inode: 77, InqSeq: 1000, InqLen: 5, OutqSeq: 2000, OutqLen: 0,
		}},
	}
}

func openStore(t testing.TB, node string) *ckpt.Store {
	t.Helper()
	s, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func makeSnapshot(t testing.TB, s *ckpt.Store, job string, files map[string][]byte) *ckpt.Manifest {
	t.Helper()
	p, err := s.Begin(job)
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range files {
		path := filepath.Join(p.Dir(), filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	m, err := p.Commit(context.Background(), testInfo())
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func smallFiles() map[string][]byte {
	return map[string][]byte{
		"pages-1.img":       memoryPages(2<<20+123, 1),
		"pagemap-1.img":     []byte("pagemap entries"),
		"inventory.img":     {},
		"tcp-stream-77.img": bytes.Repeat([]byte("q"), 5000),
		"sub/dir/out.txt":   []byte("nested"),
	}
}

// serveTCP accepts one connection and runs Receive on it until the sender
// closes; results go to the returned channel.
type recvResult struct {
	res []*Received
	err error
}

func serveTCP(t *testing.T, store *ckpt.Store, opts ReceiveOptions) (string, <-chan recvResult) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	out := make(chan recvResult, 1)
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			out <- recvResult{err: err}
			return
		}
		defer conn.Close()
		var rr recvResult
		for {
			r, err := Receive(context.Background(), conn, store, opts)
			if err == io.EOF {
				break
			}
			if err != nil {
				rr.err = err
				break
			}
			rr.res = append(rr.res, r)
		}
		out <- rr
	}()
	return ln.Addr().String(), out
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func noLeftovers(t *testing.T, s *ckpt.Store, job string) {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(s.Root(), job))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("leftover %s in %s", e.Name(), job)
		}
	}
}

func TestShipLoopbackTCP(t *testing.T) {
	origin := openStore(t, "node1")
	prot := openStore(t, "prot")
	m1 := makeSnapshot(t, origin, "lu", smallFiles())
	m2 := makeSnapshot(t, origin, "lu", map[string][]byte{"pages-1.img": memoryPages(300<<10, 2)})
	addr, results := serveTCP(t, prot, ReceiveOptions{Peer: "node1", Authorize: FromNode("node1")})
	conn := dial(t, addr)
	ctx := context.Background()

	// Two snapshots over one connection, then the first again (already there).
	s1, err := Send(ctx, conn, origin, "lu", m1.ID, SendOptions{Peer: "prot"})
	if err != nil {
		t.Fatal(err)
	}
	if s1.Bytes != m1.TotalSize() || s1.AlreadyPresent {
		t.Errorf("sent %d bytes (already=%v), snapshot has %d", s1.Bytes, s1.AlreadyPresent, m1.TotalSize())
	}
	if s1.WireBytes >= s1.Bytes {
		t.Errorf("no compression: %d wire bytes for %d", s1.WireBytes, s1.Bytes)
	}
	if !slices.Equal(s1.Manifest.Replicas, []string{"prot"}) {
		t.Errorf("origin replicas %v", s1.Manifest.Replicas)
	}
	if _, err := Send(ctx, conn, origin, "lu", m2.ID, SendOptions{Peer: "prot"}); err != nil {
		t.Fatal(err)
	}
	again, err := Send(ctx, conn, origin, "lu", m1.ID, SendOptions{Peer: "prot"})
	if err != nil || !again.AlreadyPresent {
		t.Fatalf("resend: %+v %v", again, err)
	}
	conn.Close()
	rr := <-results
	if rr.err != nil {
		t.Fatalf("receiver: %v", rr.err)
	}
	if len(rr.res) != 3 || !rr.res[2].AlreadyHad || rr.res[0].Bytes != m1.TotalSize() {
		t.Errorf("receiver results %+v", rr.res)
	}

	for _, m := range []*ckpt.Manifest{m1, m2} {
		got, err := prot.Verify(ctx, "lu", m.ID)
		if err != nil {
			t.Fatalf("protector copy: %v", err)
		}
		if !slices.Equal(got.Files, m.Files) || got.Conns[0] != m.Conns[0] || got.Parent != m.Parent {
			t.Errorf("protector manifest differs")
		}
		if !slices.Equal(got.Replicas, []string{"node1"}) {
			t.Errorf("protector replicas %v", got.Replicas)
		}
		b, _ := os.ReadFile(filepath.Join(prot.Path("lu", m.ID), "pages-1.img"))
		want, _ := os.ReadFile(filepath.Join(origin.Path("lu", m.ID), "pages-1.img"))
		if !bytes.Equal(b, want) {
			t.Errorf("pages differ")
		}
	}
	if latest, err := prot.Latest("lu", "node1"); err != nil || latest.ID != m2.ID {
		t.Errorf("protector Latest(lu,node1) = %v %v", latest, err)
	}
	noLeftovers(t, prot, "lu")

	// After node1 fails, the protector forwards its copy to a spare.
	spare := openStore(t, "spare")
	addr, results = serveTCP(t, spare, ReceiveOptions{Peer: "prot"})
	conn = dial(t, addr)
	fwd, err := Send(ctx, conn, prot, "lu", m2.ID, SendOptions{Peer: "spare"})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(fwd.Manifest.Replicas, []string{"node1", "spare"}) {
		t.Errorf("protector replicas after forwarding %v", fwd.Manifest.Replicas)
	}
	conn.Close()
	if rr := <-results; rr.err != nil {
		t.Fatal(rr.err)
	}
	got, err := spare.Verify(ctx, "lu", m2.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Node != "node1" || !slices.Equal(got.Replicas, []string{"prot"}) {
		t.Errorf("spare copy: node %s replicas %v", got.Node, got.Replicas)
	}
}

func TestShipRefusals(t *testing.T) {
	tests := []struct {
		name      string
		recv      ReceiveOptions
		send      SendOptions
		damage    func(dir string)
		wantLocal error  // error kind on the sender for local damage
		wantMsg   string // in the sender's error
	}{
		{name: "peer not allowed", recv: ReceiveOptions{Peer: "node9", Authorize: FromNode("node9")}, wantMsg: `peer "node9" may not send snapshots of node "node1"`},
		{name: "too big", recv: ReceiveOptions{MaxSnapshotBytes: 1000}, wantMsg: "more than the 1000 this receiver accepts"},
		{name: "refused at the commit", recv: ReceiveOptions{BeforeCommit: func(*ckpt.Manifest) (func(error), error) {
			return nil, errors.New("node1 was declared failed")
		}}, wantMsg: "node1 was declared failed"},
		{name: "local corrupt", damage: func(dir string) {
			p := filepath.Join(dir, "pages-1.img")
			b, _ := os.ReadFile(p)
			b[len(b)/2] ^= 0xff
			os.WriteFile(p, b, 0o644)
		}, wantLocal: ckpt.ErrCorrupt, wantMsg: "pages-1.img"},
		// A sender that does not hash again what it committed moments ago: the protector refuses the copy.
		{name: "local corrupt, just committed", send: SendOptions{JustCommitted: true}, damage: func(dir string) {
			p := filepath.Join(dir, "pages-1.img")
			b, _ := os.ReadFile(p)
			b[len(b)/2] ^= 0xff
			os.WriteFile(p, b, 0o644)
		}, wantMsg: "pages-1.img: corrupt"},
		{name: "local truncated, just committed", send: SendOptions{JustCommitted: true}, damage: func(dir string) {
			os.Truncate(filepath.Join(dir, "tcp-stream-77.img"), 100)
		}, wantLocal: ckpt.ErrTruncated, wantMsg: "tcp-stream-77.img"},
		{name: "local truncated", damage: func(dir string) {
			os.Truncate(filepath.Join(dir, "tcp-stream-77.img"), 100)
		}, wantLocal: ckpt.ErrTruncated, wantMsg: "tcp-stream-77.img"},
		{name: "local missing", damage: func(dir string) {
			os.Remove(filepath.Join(dir, "sub/dir/out.txt"))
		}, wantLocal: ckpt.ErrMissing, wantMsg: "sub/dir/out.txt"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			origin := openStore(t, "node1")
			prot := openStore(t, "prot")
			m := makeSnapshot(t, origin, "job", smallFiles())
			if tc.damage != nil {
				tc.damage(origin.Path("job", m.ID))
			}
			addr, results := serveTCP(t, prot, tc.recv)
			conn := dial(t, addr)
			opts := tc.send
			opts.Peer = "prot"
			_, err := Send(context.Background(), conn, origin, "job", m.ID, opts)
			if err == nil {
				t.Fatal("Send succeeded")
			}
			if !strings.Contains(err.Error(), tc.wantMsg) {
				t.Errorf("error %q lacks %q", err, tc.wantMsg)
			}
			if tc.wantLocal != nil {
				if !errors.Is(err, tc.wantLocal) {
					t.Errorf("error %v is not %v", err, tc.wantLocal)
				}
			} else if _, ok := errors.AsType[*RemoteError](err); !ok {
				t.Errorf("error %v is not a RemoteError", err)
			}
			conn.Close()
			if rr := <-results; rr.err == nil {
				t.Error("receiver reported success")
			}
			if ids, _ := prot.List("job", ""); len(ids) != 0 {
				t.Errorf("protector has %v", ids)
			}
			noLeftovers(t, prot, "job")
			if got, _ := origin.Manifest("job", m.ID); got != nil && got.Replicated() {
				t.Errorf("replica recorded without an acknowledgement: %v", got.Replicas)
			}
		})
	}
}

func TestSendHonoursContext(t *testing.T) {
	origin := openStore(t, "node1")
	m := makeSnapshot(t, origin, "job", smallFiles())
	// A "protector" that accepts and never answers.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err == nil {
			io.Copy(io.Discard, c)
			c.Close()
		}
	}()
	conn := dial(t, ln.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = Send(ctx, conn, origin, "job", m.ID, SendOptions{Peer: "prot"})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Send = %v, want deadline exceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Send took %v after the context ended", d)
	}
}

// streamParts builds a transfer by hand so tests can break it.
type streamParts struct {
	hello    []byte
	manifest []byte
	base     []byte   // protocol 2 and later: the BASE frame
	files    [][]byte // each FILE..END, in order
	done     []byte
	compress func([]byte) []byte // as the sender's protocol version does
}

func frame(t frameType, p []byte) []byte {
	var b bytes.Buffer
	writeFrame(&b, t, p)
	return b.Bytes()
}

// compress is what a protocol-1 or -2 sender sends: an LZ4 frame.
func compress(data []byte) []byte {
	var b bytes.Buffer
	zw := lz4.NewWriter(&b)
	zw.Write(data)
	zw.Close()
	return b.Bytes()
}

// compressS2 is what a protocol-3 sender sends: an S2 stream.
func compressS2(data []byte) []byte {
	var b bytes.Buffer
	zw := newCompressor(1)
	zw.Reset(&b)
	zw.Write(data)
	zw.Close()
	return b.Bytes()
}

func fileFrames(name string, size int64, compressed []byte) []byte {
	var b bytes.Buffer
	b.Write(frame(frameFile, filePayload(name, size)))
	for len(compressed) > 0 {
		k := min(len(compressed), 1000)
		b.Write(frame(frameData, compressed[:k]))
		compressed = compressed[k:]
	}
	b.Write(frame(frameEnd, nil))
	return b.Bytes()
}

func validStream(t testing.TB, m *ckpt.Manifest, files map[string][]byte) streamParts {
	mb, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	sp := streamParts{hello: frame(frameHello, helloV1()), manifest: frame(frameManifest, mb), done: frame(frameDone, nil), compress: compress}
	for _, f := range m.Files {
		sp.files = append(sp.files, fileFrames(f.Name, f.Size, compress(files[f.Name])))
	}
	return sp
}

// validStreamV3 is validStream as this version's sender speaks it: no base, S2.
func validStreamV3(t testing.TB, m *ckpt.Manifest, files map[string][]byte) streamParts {
	sp := validStream(t, m, files)
	sp.hello, sp.base, sp.compress = frame(frameHello, helloPayload()), frame(frameBase, nil), compressS2
	for i, f := range m.Files {
		sp.files[i] = fileFrames(f.Name, f.Size, compressS2(files[f.Name]))
	}
	return sp
}

func (sp streamParts) bytes() []byte {
	b := slices.Concat(sp.hello, sp.manifest, sp.base)
	for _, f := range sp.files {
		b = append(b, f...)
	}
	return append(b, sp.done...)
}

type fakeConn struct {
	io.Reader
	out bytes.Buffer
}

func (f *fakeConn) Write(p []byte) (int, error) { return f.out.Write(p) }

// hostileManifest is a small manifest (origin "node1") for crafted streams.
func hostileManifest(t testing.TB) (*ckpt.Manifest, map[string][]byte) {
	origin := openStore(t, "node1")
	files := map[string][]byte{"a.img": []byte("hello hello hello"), "d/b.img": bytes.Repeat([]byte{0}, 10000)}
	return makeSnapshot(t, origin, "job", files), files
}

func TestReceiveHostileStreams(t *testing.T) {
	m, files := hostileManifest(t)
	tests := []struct {
		name   string
		stream func(sp streamParts) []byte
		want   string
	}{
		{"valid", func(sp streamParts) []byte { return sp.bytes() }, ""},
		{"bad magic", func(sp streamParts) []byte { sp.hello = frame(frameHello, []byte("HTTP/1.1 2")); return sp.bytes() }, "bad HELLO"},
		{"future version", func(sp streamParts) []byte {
			sp.hello = frame(frameHello, append(helloMagic[:], 0, 9))
			return sp.bytes()
		}, "version 9"},
		{"unknown frame", func(sp streamParts) []byte { sp.manifest = []byte{99, 0, 0, 0, 0}; return sp.bytes() }, "unknown frame"},
		{"huge length", func(sp streamParts) []byte {
			sp.files[0] = []byte{byte(frameFile), 0xff, 0xff, 0xff, 0xff}
			return sp.bytes()
		}, "exceeds"},
		{"huge data frame", func(sp streamParts) []byte {
			sp.files[0] = slices.Concat(frame(frameFile, filePayload("a.img", 17)), []byte{byte(frameData), 0, 0x20, 0, 0})
			return sp.bytes()
		}, "exceeds"},
		{"corrupt manifest", func(sp streamParts) []byte { sp.manifest[40] ^= 1; return sp.bytes() }, "manifest"},
		{"path traversal", func(sp streamParts) []byte {
			sp.files[0] = fileFrames("../../escape.img", 17, sp.compress(files["a.img"]))
			return sp.bytes()
		}, "file name"},
		{"absolute path", func(sp streamParts) []byte {
			sp.files[0] = fileFrames("/tmp/escape.img", 17, sp.compress(files["a.img"]))
			return sp.bytes()
		}, "file name"},
		{"wrong order", func(sp streamParts) []byte { sp.files[0], sp.files[1] = sp.files[1], sp.files[0]; return sp.bytes() }, "manifest order"},
		{"wrong content", func(sp streamParts) []byte {
			sp.files[0] = fileFrames("a.img", 17, sp.compress([]byte("hellO hello hello")))
			return sp.bytes()
		}, "sha256"},
		{"short content", func(sp streamParts) []byte {
			sp.files[0] = fileFrames("a.img", 17, sp.compress([]byte("hello")))
			return sp.bytes()
		}, "truncated"},
		{"decompression bomb", func(sp streamParts) []byte {
			sp.files[1] = fileFrames("d/b.img", 10000, sp.compress(make([]byte, 50<<20)))
			return sp.bytes()
		}, "more than the 10000 bytes"},
		{"garbage instead of compressed data", func(sp streamParts) []byte {
			sp.files[0] = fileFrames("a.img", 17, []byte("definitely not compressed"))
			return sp.bytes()
		}, "decompress"},
		{"trailing garbage after the compressed data", func(sp streamParts) []byte {
			sp.files[0] = fileFrames("a.img", 17, append(sp.compress(files["a.img"]), 1, 2, 3, 4, 5, 6, 7))
			return sp.bytes()
		}, "decompress"},
		{"truncated mid-file", func(sp streamParts) []byte { b := sp.bytes(); return b[:len(sp.hello)+len(sp.manifest)+30] }, "EOF"},
		{"missing DONE", func(sp streamParts) []byte { sp.done = nil; return sp.bytes() }, "DONE"},
		{"frame inside data", func(sp streamParts) []byte {
			sp.files[0] = slices.Concat(frame(frameFile, filePayload("a.img", 17)), frame(frameDone, nil))
			return sp.bytes()
		}, "inside file data"},
		{"sender abort", func(sp streamParts) []byte {
			sp.files[1] = slices.Concat(frame(frameFile, filePayload("d/b.img", 10000)), frame(frameAbort, []byte("disk on fire\x1b[2J")))
			return sp.bytes()
		}, "sender aborted: disk on fire?[2J"},
	}
	for _, tc := range tests {
		for _, sender := range []struct {
			name   string
			stream func(testing.TB, *ckpt.Manifest, map[string][]byte) streamParts
		}{{"lz4 of v1", validStream}, {"s2 of v3", validStreamV3}} {
			t.Run(tc.name+"/"+sender.name, func(t *testing.T) {
				prot := openStore(t, "prot")
				conn := &fakeConn{Reader: bytes.NewReader(tc.stream(sender.stream(t, m, files)))}
				res, err := Receive(context.Background(), conn, prot, ReceiveOptions{})
				ids, _ := prot.List("job", "")
				if tc.want == "" {
					if err != nil {
						t.Fatalf("valid stream refused: %v", err)
					}
					if len(ids) != 1 || res.Bytes != m.TotalSize() || !bytes.Contains(conn.out.Bytes(), frame(frameOK, []byte("prot"))) {
						t.Errorf("ids %v res %+v", ids, res)
					}
					return
				}
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Receive = %v, want error containing %q", err, tc.want)
				}
				if len(ids) != 0 {
					t.Errorf("snapshot visible after refusal: %v", ids)
				}
				noLeftovers(t, prot, "job")
				if tc.name != "sender abort" && !bytes.Contains(conn.out.Bytes(), []byte{byte(frameNack)}) {
					t.Errorf("no NACK sent: %q", conn.out.Bytes())
				}
				assertConfined(t, prot)
			})
		}
	}
}

// memStore opens a store on tmpfs when there is one: the fuzzer is
// otherwise bound by directory fsyncs on disk.
func memStore(t *testing.T, node string) *ckpt.Store {
	t.Helper()
	parent, err := os.MkdirTemp("/dev/shm", "ckpt-fuzz-")
	if err != nil {
		return openStore(t, node)
	}
	t.Cleanup(func() { os.RemoveAll(parent) })
	s, err := ckpt.Open(filepath.Join(parent, "store"), ckpt.Options{Node: node})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// assertConfined checks that nothing was written next to the store's root.
func assertConfined(t *testing.T, s *ckpt.Store) {
	t.Helper()
	ents, err := os.ReadDir(filepath.Dir(s.Root()))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if filepath.Join(filepath.Dir(s.Root()), e.Name()) != s.Root() {
			t.Errorf("file %s written outside the store", e.Name())
		}
	}
}

func TestReceiveReplacesDamagedCopy(t *testing.T) {
	m, files := hostileManifest(t)
	prot := openStore(t, "prot")
	stream := validStream(t, m, files).bytes()
	if _, err := Receive(context.Background(), &fakeConn{Reader: bytes.NewReader(stream)}, prot, ReceiveOptions{}); err != nil {
		t.Fatal(err)
	}
	os.Truncate(filepath.Join(prot.Path("job", m.ID), "a.img"), 3)
	res, err := Receive(context.Background(), &fakeConn{Reader: bytes.NewReader(stream)}, prot, ReceiveOptions{})
	if err != nil || res.AlreadyHad {
		t.Fatalf("re-receive over a damaged copy: %+v %v", res, err)
	}
	if _, err := prot.Verify(context.Background(), "job", m.ID); err != nil {
		t.Error(err)
	}
}

func FuzzFrameReader(f *testing.F) {
	f.Add(frame(frameHello, helloPayload()))
	f.Add(slices.Concat(frame(frameFile, filePayload("a/b.img", 3)), frame(frameData, []byte{1, 2, 3}), frame(frameEnd, nil)))
	f.Add([]byte{byte(frameData), 0xff, 0xff, 0xff, 0xff})
	f.Add(frame(frameAccept, offersPayload([]string{"20261123T202545.107Z-node1-000001"})))
	f.Add(frame(frameBase, basePayload(&baseIndex{id: "20261123T202545.107Z-node1-000001", bs: 4096})))
	f.Fuzz(func(t *testing.T, data []byte) {
		fr := newFrameReader(bytes.NewReader(data))
		for {
			typ, p, err := fr.next()
			if err != nil {
				return
			}
			if len(p) > maxPayload(typ) {
				t.Fatalf("%v payload of %d bytes passed the %d limit", typ, len(p), maxPayload(typ))
			}
			if fr.n > int64(len(data)) {
				t.Fatalf("consumed %d of %d bytes", fr.n, len(data))
			}
			if typ == frameFile || typ == frameDFile {
				if name, _, err := parseFile(p); err == nil && ckpt.ValidFileName(name) != nil {
					t.Fatalf("parseFile accepted %q", name)
				}
			}
			if typ == frameAccept {
				if ids, err := parseOffers(p); err == nil && len(ids) > maxOffers {
					t.Fatalf("parseOffers accepted %d offers", len(ids))
				}
			}
			if typ == frameBase {
				if ref, ok, err := parseBase(p); err == nil && ok && (ref.bs < minDeltaBlock || ref.bs > maxDeltaBlock) {
					t.Fatalf("parseBase accepted block size %d", ref.bs)
				}
			}
		}
	})
}

// FuzzReceive feeds a valid HELLO+MANIFEST (+BASE for S2, protocol 3) followed by fuzzed file frames to
// the receiver: whatever it accepts must verify, and a refusal must leave
// nothing behind.
func FuzzReceive(f *testing.F) {
	m, files := hostileManifest(f)
	v1, v3 := validStream(f, m, files), validStreamV3(f, m, files)
	for _, sp := range []streamParts{v1, v3} {
		f.Add(sp.base != nil, slices.Concat(slices.Concat(sp.files...), sp.done))
		f.Add(sp.base != nil, sp.files[0])
	}
	f.Fuzz(func(t *testing.T, s2 bool, data []byte) {
		prot := memStore(t, "prot")
		prefix := slices.Concat(v1.hello, v1.manifest)
		if s2 {
			prefix = slices.Concat(v3.hello, v3.manifest, v3.base)
		}
		conn := &fakeConn{Reader: bytes.NewReader(slices.Concat(prefix, data))}
		_, err := Receive(context.Background(), conn, prot, ReceiveOptions{})
		ids, _ := prot.List("job", "")
		if err == nil {
			if _, verr := prot.Verify(context.Background(), "job", m.ID); verr != nil {
				t.Fatalf("accepted a snapshot that does not verify: %v", verr)
			}
			return
		}
		if len(ids) != 0 {
			t.Fatalf("refused stream left snapshot %v", ids)
		}
		noLeftovers(t, prot, "job")
		assertConfined(t, prot)
	})
}

// A protector that refuses mid-stream (say, its disk filled) must stop the
// sender early with its reason, not after the last byte.
func TestSendStopsOnEarlyNack(t *testing.T) {
	origin := openStore(t, "node1")
	m := makeSnapshot(t, origin, "job", map[string][]byte{"pages-1.img": memoryPages(64<<20, 9)})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	read := make(chan int64, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		fr := newFrameReader(c)
		fr.next() // HELLO
		fr.next() // MANIFEST
		writeFrame(c, frameAccept, nil)
		for fr.n < 1<<20 {
			if _, _, err := fr.next(); err != nil {
				return
			}
		}
		writeFrame(c, frameNack, []byte("no space left on device"))
		c.(*net.TCPConn).CloseWrite()
		n, _ := io.Copy(io.Discard, c)
		read <- fr.n + n
	}()
	conn := dial(t, ln.Addr().String())
	_, err = Send(context.Background(), conn, origin, "job", m.ID, SendOptions{Peer: "prot"})
	rerr, ok := errors.AsType[*RemoteError](err)
	if !ok || rerr.Reason != "no space left on device" {
		t.Fatalf("Send = %v, want the protector's reason", err)
	}
	conn.Close()
	if n := <-read; n > m.TotalSize()/2 {
		t.Errorf("sender pushed %d bytes after being refused at 1 MiB", n)
	}
	if got, _ := origin.Manifest("job", m.ID); got.Replicated() {
		t.Error("replica recorded after a NACK")
	}
}

func TestIdleTimeouts(t *testing.T) {
	origin := openStore(t, "node1")
	m := makeSnapshot(t, origin, "job", smallFiles())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	recvErr := make(chan error, 1)
	go func() {
		// First connection: a protector that reads but never answers.
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() { io.Copy(io.Discard, c); c.Close() }()
		// Second connection: a receiver facing a sender that stalls after HELLO.
		c2, err := ln.Accept()
		if err != nil {
			return
		}
		defer c2.Close()
		_, err = Receive(context.Background(), c2, openStore(t, "prot"), ReceiveOptions{IdleTimeout: 200 * time.Millisecond})
		recvErr <- err
	}()

	start := time.Now()
	conn := dial(t, ln.Addr().String())
	_, err = Send(context.Background(), conn, origin, "job", m.ID, SendOptions{Peer: "prot", IdleTimeout: 200 * time.Millisecond})
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("Send to a silent protector = %v, want a deadline error", err)
	}
	// 200 ms idle plus the 1 s allowance for verifying a small snapshot.
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("Send gave up after %v", d)
	}

	stalled := dial(t, ln.Addr().String())
	writeFrame(stalled, frameHello, helloV1())
	select {
	case err := <-recvErr:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("Receive from a stalled sender = %v, want a deadline error", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Receive did not time out")
	}
}

// assertPrivate fails for any directory of the store that is not 0700 or
// file that is not 0600.
func assertPrivate(t *testing.T, s *ckpt.Store) {
	t.Helper()
	n := 0
	err := filepath.WalkDir(s.Root(), func(path string, d fs.DirEntry, err error) error {
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
	if n < 4 {
		t.Fatalf("walked only %d entries", n)
	}
}

func TestReceivedCopyIsPrivate(t *testing.T) {
	// Even with a umask that lets everything through.
	old := unix.Umask(0)
	defer unix.Umask(old)
	m, files := hostileManifest(t) // has a subdirectory
	prot := openStore(t, "prot")
	if _, err := Receive(context.Background(), &fakeConn{Reader: bytes.NewReader(validStream(t, m, files).bytes())}, prot, ReceiveOptions{}); err != nil {
		t.Fatal(err)
	}
	assertPrivate(t, prot)
}

// sameIDSnapshots returns two snapshots of node1 with the same id and
// different content: a sender's copy that differs from the receiver's.
func sameIDSnapshots(t *testing.T) (a, b *ckpt.Manifest, fa, fb map[string][]byte) {
	t.Helper()
	clock := func() time.Time { return time.Date(2026, 11, 22, 15, 30, 0, 0, time.UTC) }
	var stores [2]*ckpt.Store
	for i := range stores {
		s, err := ckpt.Open(t.TempDir(), ckpt.Options{Node: "node1", Now: clock})
		if err != nil {
			t.Fatal(err)
		}
		stores[i] = s
	}
	fa = map[string][]byte{"a.img": []byte("hello hello hello"), "d/b.img": bytes.Repeat([]byte{0}, 10000)}
	fb = map[string][]byte{"a.img": []byte("other content"), "d/b.img": memoryPages(20000, 3), "c.img": []byte("new")}
	a, b = makeSnapshot(t, stores[0], "job", fa), makeSnapshot(t, stores[1], "job", fb)
	if a.ID != b.ID {
		t.Fatalf("setup: ids %s and %s differ", a.ID, b.ID)
	}
	return a, b, fa, fb
}

// hasContent fails unless the store's copy of m.ID holds exactly files.
func hasContent(t *testing.T, s *ckpt.Store, id string, files map[string][]byte) {
	t.Helper()
	got, err := s.Verify(context.Background(), "job", id)
	if err != nil {
		t.Fatalf("local copy does not verify: %v", err)
	}
	if len(got.Files) != len(files) {
		t.Fatalf("local copy has %d files, want %d", len(got.Files), len(files))
	}
	for name, want := range files {
		b, err := os.ReadFile(filepath.Join(s.Path("job", id), name))
		if err != nil || !bytes.Equal(b, want) {
			t.Fatalf("local %s is not the expected content (%v)", name, err)
		}
	}
}

// A receiver replacing its copy of a snapshot (damaged, or different from
// the sender's) keeps it until the replacement has verified.
func TestReceiveKeepsOldCopyUntilReplacementVerifies(t *testing.T) {
	ma, mb, fa, fb := sameIDSnapshots(t)
	failures := []struct {
		name   string
		stream func(sp streamParts) []byte
	}{
		{"connection cut mid-file", func(sp streamParts) []byte {
			b := sp.bytes()
			return b[:len(sp.hello)+len(sp.manifest)+len(sp.files[0])+100]
		}},
		{"bad sha", func(sp streamParts) []byte {
			sp.files[1] = fileFrames("c.img", 3, compress([]byte("neW")))
			return sp.bytes()
		}},
		{"sender abort", func(sp streamParts) []byte {
			sp.files[2] = slices.Concat(frame(frameFile, filePayload("d/b.img", 20000)), frame(frameAbort, []byte("read error")))
			return sp.bytes()
		}},
	}
	for _, damaged := range []bool{false, true} {
		for _, tc := range failures {
			name := tc.name
			if damaged {
				name += ", local copy damaged"
			}
			t.Run(name, func(t *testing.T) {
				prot := openStore(t, "prot")
				if _, err := Receive(context.Background(), &fakeConn{Reader: bytes.NewReader(validStream(t, ma, fa).bytes())}, prot, ReceiveOptions{}); err != nil {
					t.Fatal(err)
				}
				var before []byte
				if damaged {
					p := filepath.Join(prot.Path("job", ma.ID), "a.img")
					os.Truncate(p, 5)
					before, _ = os.ReadFile(p)
				}
				conn := &fakeConn{Reader: bytes.NewReader(tc.stream(validStream(t, mb, fb)))}
				if _, err := Receive(context.Background(), conn, prot, ReceiveOptions{}); err == nil {
					t.Fatal("broken replacement accepted")
				}
				noLeftovers(t, prot, "job")
				if ids, _ := prot.List("job", ""); !slices.Equal(ids, []string{ma.ID}) {
					t.Fatalf("after a failed replacement List = %v, want the old copy %s", ids, ma.ID)
				}
				if damaged {
					// Still the same (damaged) bytes: nothing was deleted.
					if b, err := os.ReadFile(filepath.Join(prot.Path("job", ma.ID), "a.img")); err != nil || !bytes.Equal(b, before) {
						t.Fatalf("damaged copy changed: %q %v", b, err)
					}
				} else {
					hasContent(t, prot, ma.ID, fa)
				}

				// The same replacement, intact, takes the old copy's place.
				res, err := Receive(context.Background(), &fakeConn{Reader: bytes.NewReader(validStream(t, mb, fb).bytes())}, prot, ReceiveOptions{Peer: "node1"})
				if err != nil || res.AlreadyHad {
					t.Fatalf("intact replacement: %+v %v", res, err)
				}
				hasContent(t, prot, mb.ID, fb)
				noLeftovers(t, prot, "job")
				assertPrivate(t, prot)
			})
		}
	}
}

// pipeShip sends one snapshot from origin to prot over net.Pipe and returns
// what the receiver got.
func pipeShip(t *testing.T, origin, prot *ckpt.Store, id string) *Received {
	t.Helper()
	c1, c2 := net.Pipe()
	defer c1.Close()
	type result struct {
		r   *Received
		err error
	}
	got := make(chan result, 1)
	go func() {
		defer c2.Close()
		r, err := Receive(context.Background(), c2, prot, ReceiveOptions{Peer: "node1", Authorize: FromNode("node1")})
		got <- result{r, err}
	}()
	if _, err := Send(context.Background(), c1, origin, "job", id, SendOptions{Peer: "prot"}); err != nil {
		t.Fatal(err)
	}
	res := <-got
	if res.err != nil {
		t.Fatal(res.err)
	}
	return res.r
}

// A protector applies retention after every received snapshot, as the agent
// does: it keeps the newest keep copies of the sender's snapshots, and never
// the newest copy that verifies, even when every newer one is damaged.
func TestProtectorRetention(t *testing.T) {
	const keep = 2
	origin := openStore(t, "node1")
	prot := openStore(t, "prot")
	var ids []string // oldest first
	prune := func(r *Received) []string {
		t.Helper()
		deleted, err := prot.PruneReceived(context.Background(), r.Manifest.Job, r.Manifest.Node, keep, r.Manifest.ID)
		if err != nil {
			t.Fatal(err)
		}
		return deleted
	}
	for i := range 5 {
		m := makeSnapshot(t, origin, "job", map[string][]byte{"pages-1.img": memoryPages(64<<10, uint64(i))})
		ids = append(ids, m.ID)
		prune(pipeShip(t, origin, prot, m.ID))
		left, _ := prot.List("job", "node1")
		if want := min(i+1, keep); len(left) != want {
			t.Fatalf("after %d snapshots the protector holds %d, want %d", i+1, len(left), want)
		}
	}
	newest := []string{ids[4], ids[3]}
	if left, _ := prot.List("job", "node1"); !slices.Equal(left, newest) {
		t.Fatalf("protector holds %v, want the newest %v", left, newest)
	}
	for _, id := range newest {
		if _, err := prot.Verify(context.Background(), "job", id); err != nil {
			t.Fatal(err)
		}
	}

	// An old snapshot sent again (out of order) is received and, being
	// older than keep intact copies, pruned at once.
	if d := prune(pipeShip(t, origin, prot, ids[0])); !slices.Equal(d, []string{ids[0]}) {
		t.Errorf("resent old snapshot: deleted %v, want %v", d, ids[:1])
	}
	// Damage both kept copies: the old snapshot sent again is now the newest
	// that verifies and must stay.
	for _, id := range newest {
		p := filepath.Join(prot.Path("job", id), "pages-1.img")
		b, _ := os.ReadFile(p)
		b[100] ^= 1
		os.WriteFile(p, b, 0o600)
	}
	if d := prune(pipeShip(t, origin, prot, ids[0])); len(d) != 0 {
		t.Errorf("deleted %v although no newer copy verifies", d)
	}
	m, _, err := prot.LatestVerified(context.Background(), "job", "node1")
	if err != nil || m.ID != ids[0] {
		t.Fatalf("latest verified copy: %v %v, want %s", m, err, ids[0])
	}
}

// A transfer of a snapshot another writer is receiving at the same time is
// refused with the reason, and the other writer's copy is untouched.
func TestReceiveRefusesConcurrentWriter(t *testing.T) {
	m, files := hostileManifest(t)
	for _, replace := range []bool{false, true} {
		prot := openStore(t, "prot")
		if replace {
			if _, err := Receive(context.Background(), &fakeConn{Reader: bytes.NewReader(validStream(t, m, files).bytes())}, prot, ReceiveOptions{}); err != nil {
				t.Fatal(err)
			}
			os.Truncate(filepath.Join(prot.Path("job", m.ID), "a.img"), 1)
		}
		other, err := prot.BeginReplace(m)
		if err != nil {
			t.Fatal(err)
		}
		conn := &fakeConn{Reader: bytes.NewReader(validStream(t, m, files).bytes())}
		_, err = Receive(context.Background(), conn, prot, ReceiveOptions{})
		if err == nil || !strings.Contains(err.Error(), "in use by another writer") {
			t.Errorf("replace=%v: Receive = %v, want a refusal naming the other writer", replace, err)
		}
		if _, err := os.Stat(other.Dir()); err != nil {
			t.Errorf("replace=%v: the other writer's directory is gone: %v", replace, err)
		}
		other.Abort()
	}
}

// helloV1 is the HELLO of a protocol-1 sender (no BASE frame), which a
// receiver still accepts; the hand-made streams of these tests speak it.
func helloV1() []byte {
	return binary.BigEndian.AppendUint16(append([]byte{}, helloMagic[:]...), 1)
}

// A send that ends inside a file stops that file's compressing goroutines: with CompressConcurrency above
// one, S2's writer keeps a goroutine per file until it is closed or reset.
func TestSendAbortEndsCompressors(t *testing.T) {
	origin := openStore(t, "node1")
	prot := openStore(t, "prot")
	m := makeSnapshot(t, origin, "job", smallFiles())
	// A file that grew after its commit is refused in the middle of its stream.
	f, err := os.OpenFile(filepath.Join(origin.Path("job", m.ID), "pages-1.img"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("more")); err != nil {
		t.Fatal(err)
	}
	f.Close()
	addr, results := serveTCP(t, prot, ReceiveOptions{})
	conn := dial(t, addr)
	if _, err := Send(context.Background(), conn, origin, "job", m.ID, SendOptions{Peer: "prot", CompressConcurrency: 2}); !errors.Is(err, ckpt.ErrCorrupt) {
		t.Fatalf("Send: %v, want %v", err, ckpt.ErrCorrupt)
	}
	// Send has returned: a compressor it left running is still parked in the writer's loop.
	stacks := make([]byte, 1<<20)
	stacks = stacks[:runtime.Stack(stacks, true)]
	if bytes.Contains(stacks, []byte("s2.(*Writer).Reset")) {
		t.Errorf("a compressing goroutine outlived the aborted send:\n%s", stacks)
	}
	conn.Close()
	<-results
}

// TestShipKeepsHoles: a job's sparse output (a stdout it seeked far into) costs the protector's disk what
// it holds: before, the receiver allocated and wrote every byte of it.
func TestShipKeepsHoles(t *testing.T) {
	const size = 256 << 20
	origin := openStore(t, "node1")
	prot := openStore(t, "prot")
	p, err := origin.Begin("job")
	if err != nil {
		t.Fatal(err)
	}
	out, err := os.Create(filepath.Join(p.Dir(), "stdout"))
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, size / 2, size - 5} {
		if _, err := out.WriteAt([]byte("rank0"), off); err != nil {
			t.Fatal(err)
		}
	}
	out.Close()
	m, err := p.Commit(context.Background(), testInfo())
	if err != nil {
		t.Fatal(err)
	}
	addr, results := serveTCP(t, prot, ReceiveOptions{})
	conn := dial(t, addr)
	if _, err := Send(context.Background(), conn, origin, "job", m.ID, SendOptions{Peer: "prot"}); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if rr := <-results; rr.err != nil || len(rr.res) != 1 {
		t.Fatalf("receiver: %d snapshots, %v", len(rr.res), rr.err)
	}
	copyPath := filepath.Join(prot.Path("job", m.ID), "stdout")
	var st unix.Stat_t
	if err := unix.Stat(copyPath, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != size {
		t.Errorf("the copy has %d bytes, want %d", st.Size, size)
	}
	if alloc := st.Blocks * 512; alloc > 1<<20 {
		t.Errorf("the copy of a %d-byte file holding 15 bytes takes %d bytes of disk, want at most 1 MiB", int64(size), alloc)
	}
	if _, err := prot.Verify(context.Background(), "job", m.ID); err != nil {
		t.Errorf("the copy does not verify: %v", err)
	}
}

// TestReceiveBoundsTransfer: a sender that keeps a transfer open without making progress, with frames
// that carry nothing or by trickling a byte at a time just inside the idle timeout, is refused once past
// what its snapshot can take (in bytes on the wire, or in time), with a NACK, and nothing of it stays.
// Before, it held the pending copy, its lock and the receiving goroutine for as long as it went on.
func TestReceiveBoundsTransfer(t *testing.T) {
	m, _ := hostileManifest(t)
	mb, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	opening := slices.Concat(frame(frameHello, helloV1()), frame(frameManifest, mb), frame(frameFile, filePayload("a.img", 17)))
	empty := frame(frameData, nil)
	tests := []struct {
		name  string
		chunk []byte        // what the sender writes again and again after the opening
		every time.Duration // between two chunks
		most  int64         // the sender gives up after this many bytes
		opts  ReceiveOptions
		want  string
	}{
		// As fast as it goes, with time to spare: the bytes on the wire refuse it.
		{"empty DATA frames", bytes.Repeat(empty, 1000), 0, 16 << 20, ReceiveOptions{IdleTimeout: time.Second, PerMiB: time.Hour}, "on the wire"},
		// One byte of an empty DATA frame every 20 ms, ten times as often as the idle timeout wants, for up
		// to 4 s: the snapshot (10 KB) may take 220 ms.
		// The whole bound (about 1 s) is past when the sender has sent some 50 of its 200 bytes: a stall of
		// the loaded machine shorter than the idle timeout (1 s) changes nothing.
		{"trickle inside the idle timeout", empty[:1], 20 * time.Millisecond, 200,
			ReceiveOptions{IdleTimeout: time.Second, PerMiB: 10 * time.Millisecond}, "not received within"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prot := openStore(t, "prot")
			c1, c2 := net.Pipe()
			nacked := make(chan struct{}) // closed once the sender has read what the receiver answers
			var nack string
			go func() {
				defer close(nacked)
				fr := newFrameReader(c1)
				for {
					typ, p, err := fr.next()
					if err != nil {
						return
					}
					if typ == frameNack {
						nack = string(p)
						return
					}
				}
			}()
			sent := make(chan int64, 1)
			go func() {
				defer c1.Close()
				var n int64
				if _, err := c1.Write(opening); err != nil {
					sent <- n
					return
				}
				tick := time.NewTicker(max(tc.every, time.Millisecond))
				defer tick.Stop()
				for i := 0; n < tc.most; i++ {
					select {
					case <-nacked:
						sent <- n
						return
					default:
					}
					if tc.every > 0 {
						<-tick.C
					}
					// The trickle sends the bytes of empty DATA frames one at a time.
					b := tc.chunk
					if len(b) == 1 {
						b = empty[i%len(empty) : i%len(empty)+1]
					}
					k, err := c1.Write(b)
					n += int64(k)
					if err != nil {
						break
					}
				}
				sent <- n
			}()
			_, err := Receive(context.Background(), c2, prot, tc.opts)
			c2.Close()
			n := <-sent
			if !errors.Is(err, ErrTransferLimit) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Receive = %v (after the sender sent %d bytes), want a refusal containing %q", err, n, tc.want)
			}
			if n >= tc.most {
				t.Errorf("refused only once the sender gave up, after %d bytes", n)
			}
			<-nacked
			if !strings.Contains(nack, tc.want) {
				t.Errorf("the sender got NACK %q, want the reason", nack)
			}
			if ids, _ := prot.List("job", ""); len(ids) != 0 {
				t.Errorf("snapshot visible after refusal: %v", ids)
			}
			noLeftovers(t, prot, "job")
		})
	}
}
