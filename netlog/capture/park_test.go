//go:build linux

package capture

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/ftkit/ftkit/netlog"
	"github.com/ftkit/ftkit/netlog/park"
	"github.com/ftkit/ftkit/tcpflow"
)

// fakeQueues is a park whose queues hold the given frames, read as a tap's are (park.Park's Free and Take).
type fakeQueues struct{ q [][][]byte }

func (f *fakeQueues) Ifindex() int { return 0 }
func (f *fakeQueues) Queues() int  { return len(f.q) }
func (f *fakeQueues) Close() error { return nil }

func (f *fakeQueues) read(q int, buf []byte) (int, error) {
	if len(f.q[q]) == 0 {
		return 0, park.ErrEmpty
	}
	n := copy(buf, f.q[q][0])
	f.q[q] = f.q[q][1:]
	return n, nil
}

func (f *fakeQueues) Free(q int, hdr []byte) (park.Frame, error) {
	n, err := f.read(q, hdr)
	if err != nil {
		return park.Frame{}, err
	}
	return park.ParseFrame(hdr[:n], false)
}

func (f *fakeQueues) Take(q int, buf []byte) (park.Frame, error) {
	n, err := f.read(q, buf)
	if err != nil {
		return park.Frame{}, err
	}
	if n == len(buf) {
		return park.Frame{}, fmt.Errorf("fake park: a clone of queue %d fills the buffer", q)
	}
	return park.ParseFrame(buf[:n], true)
}

// ipv4Frame is an Ethernet frame of an IPv4 packet of protocol proto from conn's sender, with a TCP
// header of seq (proto 6) or an 8-byte UDP one (proto 17) before payload.
func ipv4Frame(conn tcpflow.Tuple, proto byte, seq uint32, payload []byte) []byte {
	l4 := 20
	if proto == 17 {
		l4 = 8
	}
	b := make([]byte, 14+20+l4+len(payload))
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:]
	ip[0], ip[9] = 0x45, proto
	binary.BigEndian.PutUint16(ip[2:], uint16(20+l4+len(payload)))
	s, d := conn.Local.Addr().As4(), conn.Remote.Addr().As4()
	copy(ip[12:], s[:])
	copy(ip[16:], d[:])
	h := ip[20:]
	binary.BigEndian.PutUint16(h[0:], conn.Local.Port())
	binary.BigEndian.PutUint16(h[2:], conn.Remote.Port())
	if proto == 6 {
		binary.BigEndian.PutUint32(h[4:], seq)
		h[12] = 5 << 4
	}
	copy(h[l4:], payload)
	return b
}

// TestParkNonTCPStray: a frame that is not a TCP segment ahead of a clone in its queue is a stray like any
// frame no record names: skipped, and the clone behind it is still its record's. Anything the host sends
// out of the park lands in its queues, and since Linux 5.7 any user may bind a socket to a device
// (SO_BINDTODEVICE): a UDP datagram sent to ftpark0 goes to queue 0. Before, the frame's parse error counted
// the clone at the queue's head as lost (a hole in the log: recoveries refused, every member asked for a
// snapshot), and the clone itself was then skipped as a stray.
func TestParkNonTCPStray(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.MustParseAddrPort("10.0.0.2:5000")}
	user := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:41000"), Remote: netip.MustParseAddrPort("10.0.0.2:9")}
	const seq = 1000
	payload := make([]byte, 4096)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	for _, take := range []bool{true, false} {
		t.Run(fmt.Sprintf("take=%v", take), func(t *testing.T) {
			quiet := slog.New(slog.DiscardHandler)
			l, err := netlog.NewLog(netlog.Options{Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			fq := &fakeQueues{q: [][][]byte{{ipv4Frame(user, 17, 0, []byte("not a clone")), ipv4Frame(conn, 6, seq, payload)}}}
			k := newParked(quiet, fq, 1, nil, ParkOptions{Cap: 1 << 20, MaxLen: 64 << 10})
			rec := netlog.Record{Conn: conn, Seq: seq, Parked: uint32(len(payload))}
			k.push(rec)
			if err := l.NoteParked(rec); err != nil {
				t.Fatal(err)
			}
			if !take { // the receiver's snapshot covered the bytes: the clone is freed unread
				if _, err := l.Trim(conn, seq+uint32(len(payload))); err != nil {
					t.Fatal(err)
				}
			}
			var stored []netlog.Record
			store := func(r netlog.Record) error { stored = append(stored, r); return nil }
			if err := k.serviceQueue(0, l, store, take, func() bool { return true }); err != nil {
				t.Fatal(err)
			}
			if k.lost.Load() != 0 || k.strays.Load() != 1 || k.bytes != 0 || len(fq.q[0]) != 0 {
				t.Errorf("%d clones lost, %d strays, %d bytes still booked, %d frames left; want none lost, 1 stray, the clone read",
					k.lost.Load(), k.strays.Load(), k.bytes, len(fq.q[0]))
			}
			switch {
			case take && (len(stored) != 1 || stored[0].Conn != conn || stored[0].Seq != seq || string(stored[0].Payload) != string(payload)):
				t.Errorf("took %d records into the log, want the clone's", len(stored))
			case !take && (len(stored) != 0 || k.freed.Load() != uint64(len(payload))):
				t.Errorf("took %d records, freed %d bytes; want the clone freed unread", len(stored), k.freed.Load())
			}
		})
	}
}

// TestParkTakeDualStackConn: a take asked for by a dual-stack socket's tuple (an IPv4-mapped IPv6 address,
// as CRIU's images of a job listening on [::] name its connections, and so a restorer's range request) takes
// the clones of its IPv4 destination's bucket. Before, the mapped address was put in bucket 0: the clones
// stayed parked in their own bucket, the range read found them missing from the log, and the recovery was
// refused for a hole.
func TestParkTakeDualStackConn(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.77.0.1:40000"), Remote: netip.MustParseAddrPort("10.77.0.2:5000")}
	mapped := tcpflow.Tuple{
		Local:  netip.AddrPortFrom(netip.AddrFrom16(conn.Local.Addr().As16()), conn.Local.Port()),
		Remote: netip.AddrPortFrom(netip.AddrFrom16(conn.Remote.Addr().As16()), conn.Remote.Port()),
	}
	const buckets, seq = 8, 1000
	payload := make([]byte, 4096)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	quiet := slog.New(slog.DiscardHandler)
	l, err := netlog.NewLog(netlog.Options{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// One CPU: queue i holds bucket i's clones.
	q := park.Bucket(conn.Remote.Addr(), buckets)
	fq := &fakeQueues{q: make([][][]byte, buckets)}
	fq.q[q] = [][]byte{ipv4Frame(conn, 6, seq, payload)}
	k := newParked(quiet, fq, buckets, nil, ParkOptions{Cap: 1 << 20, MaxLen: 64 << 10})
	rec := netlog.Record{Conn: conn, Seq: seq, Parked: uint32(len(payload)), Queue: uint32(q)}
	k.push(rec)
	if err := l.NoteParked(rec); err != nil {
		t.Fatal(err)
	}
	var stored []netlog.Record
	store := func(r netlog.Record) error { stored = append(stored, r); return nil }
	take := k.maskOf(mapped.Remote.Addr()) // what Want(mapped) asks the consumer for
	for qi := range fq.q {
		if err := k.serviceQueue(qi, l, store, take&(1<<(qi%buckets)) != 0, func() bool { return true }); err != nil {
			t.Fatal(err)
		}
	}
	if len(stored) != 1 || string(stored[0].Payload) != string(payload) || k.bytes != 0 {
		t.Errorf("a take for %v (mask %#x) took %d records, %d bytes still parked in queue %d; want the clone taken",
			mapped, uint64(take), len(stored), k.bytes, q)
	}
}

// TestParkFastOpenSYN: the clone of a SYN that carries data (TCP Fast Open: a client's first segment, up to
// an MSS, 4 KiB and more on jumbo frames) is its record's. The program's record starts the payload one past
// the SYN's sequence number, which the SYN itself takes; the clone was matched by the header's number: it
// was skipped as a stray, and the record counted lost (a hole in the log: recoveries refused, every member
// asked for a snapshot).
func TestParkFastOpenSYN(t *testing.T) {
	conn := tcpflow.Tuple{Local: netip.MustParseAddrPort("10.0.0.1:40000"), Remote: netip.MustParseAddrPort("10.0.0.2:5000")}
	var isn uint32 = 0xffffffff // the payload's first byte wraps to 0
	payload := make([]byte, 4096)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	for _, take := range []bool{true, false} {
		t.Run(fmt.Sprintf("take=%v", take), func(t *testing.T) {
			quiet := slog.New(slog.DiscardHandler)
			l, err := netlog.NewLog(netlog.Options{Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			syn := ipv4Frame(conn, 6, isn, payload)
			syn[14+20+13] |= 0x02 // SYN
			next := ipv4Frame(conn, 6, isn+1+uint32(len(payload)), payload)
			fq := &fakeQueues{q: [][][]byte{{syn, next}}}
			k := newParked(quiet, fq, 1, nil, ParkOptions{Cap: 1 << 20, MaxLen: 64 << 10})
			// The records as bpf/tcplog.c writes them: the SYN's payload at isn+1.
			for _, rec := range []netlog.Record{
				{Conn: conn, Seq: isn + 1, Parked: uint32(len(payload))},
				{Conn: conn, Seq: isn + 1 + uint32(len(payload)), Parked: uint32(len(payload))},
			} {
				k.push(rec)
				if err := l.NoteParked(rec); err != nil {
					t.Fatal(err)
				}
			}
			if !take {
				if _, err := l.Trim(conn, isn+1+2*uint32(len(payload))); err != nil {
					t.Fatal(err)
				}
			}
			var stored []netlog.Record
			store := func(r netlog.Record) error { stored = append(stored, r); return nil }
			if err := k.serviceQueue(0, l, store, take, func() bool { return true }); err != nil {
				t.Fatal(err)
			}
			if k.lost.Load() != 0 || k.strays.Load() != 0 || k.bytes != 0 {
				t.Fatalf("%d clones lost, %d strays, %d bytes still booked; want both clones read as their records'",
					k.lost.Load(), k.strays.Load(), k.bytes)
			}
			if take && (len(stored) != 2 || stored[0].Seq != isn+1 || string(stored[0].Payload) != string(payload)) {
				t.Errorf("took %d records into the log, want the SYN's payload at %d and the next segment's", len(stored), isn+1)
			}
		})
	}
}
