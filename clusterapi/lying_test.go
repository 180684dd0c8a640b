package clusterapi

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"github.com/ftkit/ftkit/internal/testenv"
	"io"
	"math"
	"net/http"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/spare"
	"github.com/ftkit/ftkit/tcpflow"
)

// TestLogRangeLyingPeer has the peer announce more logged bytes than it sends, a negative or a huge
// length: the caller must refuse, and never allocate what was announced.
func TestLogRangeLyingPeer(t *testing.T) {
	tests := []struct {
		name    string
		len     int64
		send    int
		then    string // "close" or "stall"
		wantErr string // "" for success
	}{
		{"as announced", 1000, 1000, "close", ""},
		{"nothing announced", 0, 0, "close", ""},
		{"1 GiB announced, 10 bytes sent", 1 << 30, 10, "close", "got 10"},
		{"more announced than sent, then silence", 1 << 20, 10, "stall", "stalled"},
		{"a negative length", -1, 0, "close", "announces -1 logged bytes"},
		{"a huge length", 1 << 40, 0, "close", "announces 1099511627776 logged bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				WriteLine(w, LogRangeReply{From: 7, Len: tt.len})
				w.Write(bytes.Repeat([]byte{'b'}, tt.send))
				w.(http.Flusher).Flush()
				if tt.then == "stall" {
					<-t.Context().Done()
				}
			}))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, shortTimeouts)
			runtime.GC()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			var (
				data []byte
				err  error
			)
			testenv.ReturnsWithin(t, failAfter, func() { _, data, err = c.LogRange(context.Background(), "n2", LogRangeRequest{From: 7}) })
			runtime.ReadMemStats(&after)
			if tt.wantErr == "" {
				if err != nil || len(data) != tt.send {
					t.Fatalf("%d bytes, %v; want %d", len(data), err, tt.send)
				}
			} else if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want one saying %q", err, tt.wantErr)
			}
			// TLS, the handshake and the reply take well under a few MiB; of the announced length (1 GiB
			// and more in the lying cases) no more than the buffer allocated up front may show up.
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > logBytesUpFront+16<<20 {
				t.Errorf("the call allocated %d MiB for %d bytes sent", alloc>>20, tt.send)
			}
		})
	}
}

// answering is a handler that answers every request with v.
func answering(v any) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { WriteLine(w, v) })
}

// TestReceivedChecksTheRecord: a member's record of what it received is used only if it is of the
// connection asked about and well formed.
func TestReceivedChecksTheRecord(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.77.0.3:6000"), Remote: netip.MustParseAddrPort("10.77.0.2:5000")}
	other := tcpflow.Tuple{Local: conn.Local, Remote: netip.MustParseAddrPort("10.77.0.2:5001")}
	good := recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{{Seq: 100, Len: recvdigest.BlockSize - 100, CRC: 1}, {Seq: recvdigest.BlockSize, Len: 10, CRC: 2}}}
	tests := []struct {
		name    string
		reply   ReceivedReply
		wantErr string
	}{
		{"as asked", ReceivedReply{Received: &good}, ""},
		{"nothing at all", ReceivedReply{}, "sent no record"},
		{"another connection", ReceivedReply{Received: &recvdigest.Received{Conn: other, Pieces: good.Pieces}}, "not of"},
		{"a piece across a block boundary", ReceivedReply{Received: &recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{{Seq: 100, Len: recvdigest.BlockSize, CRC: 1}}}}, "crosses a 65536-byte block boundary"},
		{"pieces out of order", ReceivedReply{Received: &recvdigest.Received{Conn: conn, Pieces: []recvdigest.Piece{good.Pieces[1], good.Pieces[0]}}}, "overlaps or precedes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", answering(tt.reply))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, testTimeouts)
			got, err := c.Received(t.Context(), "n2", ReceivedRequest{Tuple: tcpflow.Tuple{Local: conn.Local, Remote: conn.Remote}})
			if tt.wantErr == "" {
				if err != nil || got.Received == nil || got.Received.Conn != conn || len(got.Received.Pieces) != 2 {
					t.Fatalf("Received = %+v, %v; want the record", got, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want one saying %q", err, tt.wantErr)
			}
		})
	}
}

// TestProbeChecksTheAnswer: a member's answer whether it reaches a suspect counts only if it is about the
// member asked about: "reachable" about another one kept a failed suspect from being failed over.
func TestProbeChecksTheAnswer(t *testing.T) {
	for _, tt := range []struct {
		name    string
		reply   ProbeReply
		wantErr string
	}{
		{"as asked", ProbeReply{Name: "n3", Reachable: true}, ""},
		{"about another member", ProbeReply{Name: "n4", Reachable: true}, `answered about "n4"`},
		{"about nobody", ProbeReply{Reachable: true}, `answered about ""`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", answering(tt.reply))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, testTimeouts)
			got, err := c.Probe(t.Context(), "n2", ProbeRequest{Name: "n3"})
			if tt.wantErr == "" {
				if err != nil || !got.Reachable {
					t.Fatalf("Probe = %+v, %v; want the answer", got, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("Probe = %+v, %v; want an error saying %q", got, err, tt.wantErr)
			}
		})
	}
}

// TestLoggedChecksTheAnswer: a peer may name only flows it was asked about as unlogged, and say of only
// those that they lost their live state.
func TestLoggedChecksTheAnswer(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.77.0.3:6000"), Remote: netip.MustParseAddrPort("10.77.0.2:5000")}
	other := tcpflow.Tuple{Local: conn.Local, Remote: netip.MustParseAddrPort("10.77.0.2:5001")}
	tests := []struct {
		name    string
		reply   LoggedReply
		wantErr string
	}{
		{"all logged", LoggedReply{}, ""},
		{"the flow asked about", LoggedReply{Unlogged: []tcpflow.Tuple{conn}}, ""},
		{"the log off", LoggedReply{Unlogged: []tcpflow.Tuple{conn}, LogOff: true}, ""},
		{"a flow not asked about", LoggedReply{Unlogged: []tcpflow.Tuple{conn, other}}, "not asked about"},
		{"its live state lost", LoggedReply{Unlogged: []tcpflow.Tuple{conn}, StateLost: []tcpflow.Tuple{conn}}, ""},
		{"a live state lost, not named unlogged", LoggedReply{StateLost: []tcpflow.Tuple{conn}}, "does not name it unlogged"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", answering(tt.reply))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, testTimeouts)
			got, err := c.Logged(t.Context(), "n2", LoggedRequest{Flows: []tcpflow.Tuple{conn}})
			if tt.wantErr == "" {
				if err != nil || !slices.Equal(got.Unlogged, tt.reply.Unlogged) || got.LogOff != tt.reply.LogOff ||
					!slices.Equal(got.StateLost, tt.reply.StateLost) {
					t.Fatalf("Logged = %+v, %v; want %+v", got, err, tt.reply)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want one saying %q", err, tt.wantErr)
			}
		})
	}
}

// TestReplicaChecksTheAnswer: another member's replica names the snapshot a target will fetch: it must be
// of the job and node asked about, with a valid id.
func TestReplicaChecksTheAnswer(t *testing.T) {
	req := ReplicaRequest{Job: "job-1", Node: "n3"}
	tests := []struct {
		name    string
		m       *ckpt.Manifest
		spares  []string // the run's spares the answer names
		wantErr string
	}{
		{"as asked", testManifest("job-1", "n3"), nil, ""},
		{"as asked, with the run's spares", testManifest("job-1", "n3"), []string{"n5", "n6"}, ""},
		{"none", nil, nil, "without a replica"},
		{"another job's", testManifest("job-2", "n3"), nil, `of job "job-2"`},
		{"another node's", testManifest("job-1", "n4"), nil, `from "n4"`},
		{"a bad id", &ckpt.Manifest{Job: "job-1", Node: "n3", ID: "../../etc"}, nil, "snapshot id"},
		{"a run's spare that is no member name", testManifest("job-1", "n3"), []string{"n5", "../x"}, "a spare of its run"},
		{"more spares than a run has", testManifest("job-1", "n3"), slices.Repeat([]string{"n5"}, spare.MaxRunSpares+1), "4097 spares of its run"},
		// The target sizes the spare it claims by the manifest's files, and fetches the id it names.
		{"a file of negative size", withFiles(testManifest("job-1", "n3"), ckpt.FileEntry{Name: "pages-1.img", Size: -1 << 40, SHA256: strings.Repeat("0", 64)}), nil, "negative size"},
		{"sizes that wrap", withFiles(testManifest("job-1", "n3"), ckpt.FileEntry{Name: "a.img", Size: math.MaxInt64, SHA256: strings.Repeat("0", 64)}, ckpt.FileEntry{Name: "b.img", Size: 2, SHA256: strings.Repeat("0", 64)}), nil, "add up to more"},
		{"an id of another node", &ckpt.Manifest{Job: "job-1", Node: "n3", ID: "20260301T120304.000Z-n9-000007", Created: time.Unix(1, 0), Info: ckpt.Info{Mode: ckpt.ModeUncoordinated}}, nil, `names node "n9"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", answering(ReplicaReply{Manifest: tt.m, RunSpares: tt.spares}))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, testTimeouts)
			_, err := c.Replica(t.Context(), "n2", req)
			if (tt.wantErr == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %v; want %q", err, tt.wantErr)
			}
		})
	}
}

// withFiles is m listing files.
func withFiles(m *ckpt.Manifest, files ...ckpt.FileEntry) *ckpt.Manifest {
	m.Files = files
	return m
}

// TestRepliesUpToAMessage: a member running many jobs answers a ping with more than a request header's
// bound; a reply longer than a message is refused.
func TestRepliesUpToAMessage(t *testing.T) {
	jobs := make([]string, 500) // ~20 KB of job ids
	for i := range jobs {
		jobs[i] = "a-job-with-a-long-name-" + strings.Repeat("x", 10)
	}
	pki := newTestPKI(t)
	addr := serveHandler(t, pki, "n2", answering(PingReply{Node: "n2", Jobs: jobs}))
	huge := serveHandler(t, pki, "n3", answering(PingReply{Node: "n3", Jobs: []string{strings.Repeat("x", MaxMessage)}}))
	c := clientOf(t, pki, "n1", map[string]string{"n2": addr, "n3": huge}, testTimeouts)
	r, err := c.Ping(t.Context(), "n2")
	if err != nil || len(r.Jobs) != len(jobs) {
		t.Fatalf("%d jobs, %v; want %d", len(r.Jobs), err, len(jobs))
	}
	if _, err := c.Ping(t.Context(), "n3"); !errors.Is(err, ErrTooLong) {
		t.Errorf("a reply longer than a message: %v; want %v", err, ErrTooLong)
	}
}

func TestReadLine(t *testing.T) {
	type msg struct {
		A string `json:"a"`
	}
	tests := []struct {
		name    string
		in      string
		limit   int
		want    string
		wantErr error // nil: any error if errText is set
		errText string
	}{
		{"a line", "{\"a\":\"x\"}\nrest", 100, "x", nil, ""},
		{"exactly the bound", "{\"a\":\"xy\"}\n", 10, "xy", nil, ""},
		{"one byte over the bound", "{\"a\":\"xyz\"}\n", 10, "", ErrTooLong, ""},
		{"no newline within the bound", strings.Repeat(" ", 1000), 10, "", ErrTooLong, ""},
		{"a line longer than the reader's buffer", strings.Repeat(" ", 10000) + "{\"a\":\"x\"}\n", 20000, "x", nil, ""},
		{"ends before the newline", "{\"a\":", 100, "", io.ErrUnexpectedEOF, ""},
		{"empty stream", "", 100, "", io.EOF, ""},
		{"empty line", "\n", 100, "", nil, "not the expected JSON"},
		{"two values on a line", "{} {}\n", 100, "", nil, "not the expected JSON"},
		{"wrong type", "{\"a\":5}\n", 100, "", nil, "not the expected JSON"},
		{"an unknown field", "{\"b\":5}\n", 100, "", nil, "unknown field"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src := strings.NewReader(tt.in)
			r := bufio.NewReaderSize(src, 16)
			var m msg
			err := ReadLine(r, &m, tt.limit)
			switch {
			case tt.wantErr == nil && tt.errText == "":
				if err != nil || m.A != tt.want {
					t.Fatalf("got %q, %v; want %q", m.A, err, tt.want)
				}
			case tt.wantErr != nil && !errors.Is(err, tt.wantErr):
				t.Fatalf("error %v; want %v", err, tt.wantErr)
			case tt.errText != "" && (err == nil || !strings.Contains(err.Error(), tt.errText)):
				t.Fatalf("error %v; want one saying %q", err, tt.errText)
			}
			// The reader holds at most one buffer beyond the line's bound.
			if consumed := len(tt.in) - src.Len(); consumed > tt.limit+1+16 {
				t.Errorf("read %d bytes for a line of at most %d", consumed, tt.limit)
			}
		})
	}
	t.Run("what follows the line is left to read", func(t *testing.T) {
		r := bufio.NewReader(strings.NewReader("{\"a\":\"x\"}\nrest"))
		var m msg
		if err := ReadLine(r, &m, 100); err != nil {
			t.Fatal(err)
		}
		if rest, _ := io.ReadAll(r); string(rest) != "rest" {
			t.Errorf("left %q; want %q", rest, "rest")
		}
	})
}

func TestReadLogBytes(t *testing.T) {
	tests := []struct {
		name    string
		n       int64
		in      string
		limit   int64
		want    string
		wantErr string
	}{
		{"all of it", 5, "hello, and more", 10, "hello", ""},
		{"nothing", 0, "", 10, "", ""},
		{"at the limit", 10, "0123456789", 10, "0123456789", ""},
		{"over the limit", 11, "0123456789a", 10, "", "a range holds 0 to 10"},
		{"negative", -1, "", 10, "", "announces -1"},
		{"short", 8, "abc", 10, "", "got 3: unexpected EOF"},
		{"longer than the first buffer", 3<<20 + 5, strings.Repeat("z", 3<<20+5), 4 << 20, strings.Repeat("z", 3<<20+5), ""},
		{"announces more than it sends", 3 << 20, "abc", 4 << 20, "", "got 3: unexpected EOF"},
	}
	const upFront = 1 << 20
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := readLogBytes(strings.NewReader(tt.in), tt.n, tt.limit, upFront)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v; want one saying %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || string(got) != tt.want {
				t.Fatalf("got %d bytes, %v; want %d", len(got), err, len(tt.want))
			}
			if tt.n <= upFront && int64(cap(got)) != tt.n {
				t.Errorf("capacity %d for %d bytes: not read into one buffer of their size", cap(got), tt.n)
			}
			if int64(cap(got)) > max(tt.n, upFront) {
				t.Errorf("capacity %d for %d bytes", cap(got), tt.n)
			}
		})
	}
}

// TestReadLogBytesOneBuffer: a range within logBytesUpFront is read into one buffer, allocated once, not
// grown from a small one (each step of which is fresh memory to fault in).
func TestReadLogBytesOneBuffer(t *testing.T) {
	const n = 8 << 20
	data := bytes.Repeat([]byte{'z'}, n)
	r := bytes.NewReader(nil)
	allocs := testing.AllocsPerRun(3, func() {
		r.Reset(data)
		got, err := ReadLogBytes(r, n, MaxLogRange)
		if err != nil || len(got) != n {
			t.Fatalf("got %d bytes, %v; want %d", len(got), err, n)
		}
	})
	if allocs > 1 {
		t.Errorf("%v allocations to read %d bytes; want 1", allocs, n)
	}
}

// TestAnswersOfManyConnections: a replica is answered with its whole manifest, which ckpt accepts up to
// ckpt.MaxManifestBytes, and a dump of a run's jobs with their snapshots' connections: a job with
// thousands of connections (a server with as many clients) has both past a member message. Such answers
// were refused as too long: a failure of the job's node found no replica on its holder although the holder
// had verified one, and every coordinated snapshot of its run was given up.
func TestAnswersOfManyConnections(t *testing.T) {
	m := testManifest("job-1", "n3")
	m.Created, m.Mode = time.Now().UTC(), ckpt.ModeUncoordinated
	for i := range 8000 {
		m.Conns = append(m.Conns, ckpt.Conn{
			Tuple: tcpflow.Tuple{Local: netip.AddrPortFrom(netip.MustParseAddr("10.77.0.3"), 6000),
				Remote: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 78, byte(i >> 8), byte(i)}), uint16(40000+i))},
			Inode: uint64(1_000_000 + i), InqSeq: 3_000_000_000, OutqSeq: 4_000_000_000, Timestamp: 2_000_000_000,
			SentPrefix: &ckpt.SentPrefix{Len: 65536, CRC: 4_000_000_000},
		})
	}
	enc, err := m.Encode() // the manifest as its holder keeps and ships it
	if err != nil {
		t.Fatal(err)
	}
	uid := uint32(1000)
	tests := []struct {
		name  string
		reply any
		call  func(c *Client) (conns int, err error)
	}{
		{"replica", ReplicaReply{Manifest: m}, func(c *Client) (int, error) {
			rep, err := c.Replica(t.Context(), "n2", ReplicaRequest{Job: "job-1", Node: "n3"})
			if err != nil {
				return 0, err
			}
			return len(rep.Manifest.Conns), nil
		}},
		{"dump", CoordinateReply{Parts: []CutPart{{Job: "job-1", Host: "n3", Snapshot: m.ID, Conns: m.Conns}}}, func(c *Client) (int, error) {
			rep, err := c.Coordinate(t.Context(), "n2", CoordinateRequest{Run: "r", UID: &uid, Cut: "cut-1", Phase: CoordDump})
			if err != nil || len(rep.Parts) != 1 {
				return 0, err
			}
			return len(rep.Parts[0].Conns), nil
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, _ := json.Marshal(tt.reply)
			if len(b) <= MaxMessage {
				t.Fatalf("the answer is %d bytes: not past a message (%d), the test proves nothing", len(b), MaxMessage)
			}
			pki := newTestPKI(t)
			addr := serveHandler(t, pki, "n2", answering(tt.reply))
			c := clientOf(t, pki, "n1", map[string]string{"n2": addr}, testTimeouts)
			conns, err := tt.call(c)
			if err != nil {
				t.Fatalf("an answer of %d bytes naming %d connections (the manifest file: %d bytes, which ckpt accepts): %v", len(b), len(m.Conns), len(enc), err)
			}
			if conns != len(m.Conns) {
				t.Errorf("the answer names %d connections, want %d", conns, len(m.Conns))
			}
		})
	}
}
