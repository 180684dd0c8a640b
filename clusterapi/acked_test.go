package clusterapi

import (
	"net"
	"testing"
	"time"

	"github.com/ftkit/ftkit/detect"
)

// TestAckedAdvance: the newest write whose every byte is acknowledged dates the contact; a write
// acknowledged in part does not count, and the answer never goes back.
func TestAckedAdvance(t *testing.T) {
	t0 := time.Date(2026, 11, 29, 0, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	writes := []stampedWrite{{end: 100, at: at(0)}, {end: 150, at: at(75)}, {end: 200, at: at(150)}}
	for _, tc := range []struct {
		name  string
		acked []uint64 // successive bytes_acked readings
		want  time.Time
		ok    bool
	}{
		{"nothing acknowledged", []uint64{0}, time.Time{}, false},
		{"the first write in part", []uint64{99}, time.Time{}, false},
		{"the first write", []uint64{100}, at(0), true},
		{"the second in part", []uint64{149}, at(0), true},
		{"all", []uint64{200}, at(150), true},
		{"beyond the stamped writes (unstamped ones after)", []uint64{500}, at(150), true},
		{"step by step", []uint64{100, 150, 150, 200}, at(150), true},
		{"a lower reading later", []uint64{200, 100}, at(150), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &ackedConn{writes: append([]stampedWrite(nil), writes...)}
			var got time.Time
			var ok bool
			for _, a := range tc.acked {
				got, ok = c.advance(a)
			}
			if !got.Equal(tc.want) || ok != tc.ok {
				t.Fatalf("after bytes_acked %v: %v %v, want %v %v", tc.acked, got, ok, tc.want, tc.ok)
			}
		})
	}
}

// TestAckedConnSkipsAndBounds: writes before skipFrom and the n after it are not stamped; at most
// maxStampedWrites are kept, the oldest dropped.
func TestAckedConnSkipsAndBounds(t *testing.T) {
	client, _ := tcpPair(t)
	c := &ackedConn{TCPConn: client}
	write := func() {
		if _, err := c.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	write() // a handshake's
	c.skipFrom(1)
	write() // headers
	if len(c.writes) != 0 || c.written != 2 {
		t.Fatalf("stamped %d writes of %d bytes before the skipped ones ended, want none", len(c.writes), c.written)
	}
	for range maxStampedWrites + 10 {
		write()
	}
	if len(c.writes) != maxStampedWrites || c.writes[0].end != 2+11 || c.writes[len(c.writes)-1].end != c.written {
		t.Fatalf("kept %d writes from end %d to %d (written %d), want the newest %d", len(c.writes), c.writes[0].end, c.writes[len(c.writes)-1].end, c.written, maxStampedWrites)
	}
}

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	server, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

// TestBeatStreamAcked: a heartbeat stream dates its contact by the protector's acknowledgements of its
// beats, never of its handshake or headers: nothing before the first beat, then no earlier than the
// second beat once the protector's host has it (the first may share a write with the headers).
func TestBeatStreamAcked(t *testing.T) {
	f := &fakeService{beats: make(chan detect.Beat, 4)}
	c, _, _ := serveWith(t, f, testTimeouts, testTimeouts)
	s, err := c.Heartbeats(t.Context(), "n2", failAfter)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if at, ok := s.Acked(); ok {
		t.Fatalf("contact at %v before any beat: the handshake or headers counted", at)
	}
	if err := s.Send(detect.Beat{Seq: 1}); err != nil {
		t.Fatal(err)
	}
	<-f.beats
	second := time.Now()
	if err := s.Send(detect.Beat{Seq: 2}); err != nil {
		t.Fatal(err)
	}
	<-f.beats
	var at time.Time
	for deadline := time.Now().Add(failAfter); ; time.Sleep(time.Millisecond) {
		var ok bool
		if at, ok = s.Acked(); ok && !at.Before(second) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("contact %v (acknowledged: %v), want no earlier than the second beat (%v)", at, ok, second)
		}
	}
	if at.After(time.Now()) {
		t.Fatalf("contact %v is in the future", at)
	}
}
