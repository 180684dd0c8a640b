//go:build linux

package restore

import (
	"context"
	"fmt"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
)

// soccrMark is SOCCR_MARK (criu/soccr/soccr.h): packets CRIU itself sends
// while a connection is locked carry it, and its lock rules accept them.
const soccrMark = 0xC114

// runIDTableLen is how much of the run id CRIU's table name keeps: it
// formats "inet CRIU-%s" into a 32-byte buffer (criu/netfilter.c,
// nftables_get_table), so 31 characters survive, 21 of them the run id's.
const runIDTableLen = 21

// GuardTable is the nftables table (family inet) that CRIU's restore of the
// dump with this run id deletes when it unlocks the network.
func GuardTable(runID string) string {
	if len(runID) > runIDTableLen {
		runID = runID[:runIDTableLen]
	}
	return "CRIU-" + runID
}

// Guard creates, in the calling thread's network namespace, the nftables
// table CRIU's restore of dump runID will delete (GuardTable), dropping
// every packet of conns in both directions on input and output, except
// packets marked like CRIU's own (0xC114), and every connection request (a
// TCP SYN without ACK) coming in to one of addrs: until CRIU has rebuilt the
// job's listening sockets, a peer restored or running elsewhere that
// connects to the job must meet a dropped SYN, which its TCP sends again,
// never a reset, which fails its connect (ECONNREFUSED). It replaces a table
// of that name in one transaction, so calling it again is harmless. Built
// as CRIU's own per-connection lock (criu/netfilter.c): sets conns4/conns6
// of saddr . sport . daddr . dport, and addrs4/addrs6. It speaks netlink
// itself: an nft process cost 7-9 ms of every restore, more on a loaded
// host.
func Guard(ctx context.Context, runID string, conns []ckpt.Conn, addrs []netip.Addr) error {
	if !runIDRE.MatchString(runID) {
		return fmt.Errorf("guard: run id %q is not a CRIU run id (a UUID); get it with RunID", runID)
	}
	keys, err := guardKeys(conns, addrs)
	if err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("guard: %w", err)
	}
	t := &nftables.Table{Name: GuardTable(runID), Family: nftables.TableFamilyINet}
	// Usually the table does not exist, and a batch that creates it fails
	// if it does. The replacement (add then delete in the same transaction,
	// atomic whether or not the table exists) is only sent then: closing
	// the socket after a deletion waits for the kernel to destroy the
	// table, an RCU grace period (about 15 ms).
	if err := nftBatch(func(c *nftables.Conn) error { c.CreateTable(t); return addGuard(c, t, keys) }); err == nil {
		return nil
	}
	err = nftBatch(func(c *nftables.Conn) error {
		c.AddTable(t)
		c.DelTable(t)
		c.AddTable(t)
		return addGuard(c, t, keys)
	})
	if err != nil {
		return fmt.Errorf("guard: create table inet %s: %w", t.Name, err)
	}
	return nil
}

// guardSets are the elements of a guard's sets: each connection both ways,
// as saddr . sport . daddr . dport, each field padded to 4 bytes as nftables
// concatenates them (IPv4-mapped addresses go to the IPv4 set), and the
// addresses whose incoming connection requests are dropped.
type guardSets struct{ v4, v6, addrs4, addrs6 [][]byte }

func guardKeys(conns []ckpt.Conn, addrs []netip.Addr) (guardSets, error) {
	var k guardSets
	for _, a := range addrs {
		switch a = a.Unmap(); {
		case a.Is4():
			k.addrs4 = append(k.addrs4, a.AsSlice())
		case a.Is6():
			k.addrs6 = append(k.addrs6, a.AsSlice())
		default:
			return guardSets{}, fmt.Errorf("invalid address %v", a)
		}
	}
	for _, c := range conns {
		l, r := c.Local.Addr().Unmap(), c.Remote.Addr().Unmap()
		if !c.Local.IsValid() || !c.Remote.IsValid() || l.Is4() != r.Is4() {
			return guardSets{}, fmt.Errorf("connection %v (inode %d) has invalid or mixed-family addresses", c.Tuple, c.Inode)
		}
		key := func(src netip.Addr, sport uint16, dst netip.Addr, dport uint16) []byte {
			b := append(src.AsSlice(), byte(sport>>8), byte(sport), 0, 0)
			return append(append(b, dst.AsSlice()...), byte(dport>>8), byte(dport), 0, 0)
		}
		out, in := key(l, c.Local.Port(), r, c.Remote.Port()), key(r, c.Remote.Port(), l, c.Local.Port())
		if l.Is4() {
			k.v4 = append(k.v4, out, in)
		} else {
			k.v6 = append(k.v6, out, in)
		}
	}
	return k, nil
}

// addGuard adds to batch c the guard's sets and its output and input
// chains, each as nft would build
//
//	meta mark 0xc114 accept
//	ip saddr . tcp sport . ip daddr . tcp dport @conns4 drop
//	ip6 saddr . tcp sport . ip6 daddr . tcp dport @conns6 drop
//
// and on input also
//
//	ip daddr @addrs4 tcp flags syn / syn,ack drop
//	ip6 daddr @addrs6 tcp flags syn / syn,ack drop
//
// (the registers are nft's: each field of a concatenation starts a 32-bit
// register, the first at NFT_REG_1).
func addGuard(c *nftables.Conn, t *nftables.Table, keys guardSets) error {
	type family struct {
		set, addrSet     *nftables.Set
		keys, addrs      [][]byte
		nfproto          byte
		addrOff, addrLen uint32
		regs             [4]uint32
	}
	fams := []family{
		{set: &nftables.Set{Table: t, Name: "conns4", Concatenation: true,
			KeyType: nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetService, nftables.TypeIPAddr, nftables.TypeInetService)},
			addrSet: &nftables.Set{Table: t, Name: "addrs4", KeyType: nftables.TypeIPAddr},
			keys:    keys.v4, addrs: keys.addrs4, nfproto: unix.NFPROTO_IPV4, addrOff: 12, addrLen: 4, regs: [4]uint32{1, 9, 10, 11}},
		{set: &nftables.Set{Table: t, Name: "conns6", Concatenation: true,
			KeyType: nftables.MustConcatSetType(nftables.TypeIP6Addr, nftables.TypeInetService, nftables.TypeIP6Addr, nftables.TypeInetService)},
			addrSet: &nftables.Set{Table: t, Name: "addrs6", KeyType: nftables.TypeIP6Addr},
			keys:    keys.v6, addrs: keys.addrs6, nfproto: unix.NFPROTO_IPV6, addrOff: 8, addrLen: 16, regs: [4]uint32{1, 12, 13, 17}},
	}
	for _, f := range fams {
		for _, s := range []struct {
			set  *nftables.Set
			keys [][]byte
		}{{f.set, f.keys}, {f.addrSet, f.addrs}} {
			elems := make([]nftables.SetElement, len(s.keys))
			for i, k := range s.keys {
				elems[i] = nftables.SetElement{Key: k}
			}
			if err := c.AddSet(s.set, elems); err != nil {
				return fmt.Errorf("set %s: %w", s.set.Name, err)
			}
		}
	}
	for _, hook := range []struct {
		name string
		num  *nftables.ChainHook
	}{{"output", nftables.ChainHookOutput}, {"input", nftables.ChainHookInput}} {
		ch := c.AddChain(&nftables.Chain{Name: hook.name, Table: t, Type: nftables.ChainTypeFilter,
			Hooknum: hook.num, Priority: nftables.ChainPriorityFilter})
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
			&expr.Meta{Key: expr.MetaKeyMARK, Register: 1},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(soccrMark)},
			&expr.Verdict{Kind: expr.VerdictAccept},
		}})
		for _, f := range fams {
			c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
				&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{f.nfproto}},
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
				&expr.Payload{DestRegister: f.regs[0], Base: expr.PayloadBaseNetworkHeader, Offset: f.addrOff, Len: f.addrLen},
				&expr.Payload{DestRegister: f.regs[1], Base: expr.PayloadBaseTransportHeader, Offset: 0, Len: 2},
				&expr.Payload{DestRegister: f.regs[2], Base: expr.PayloadBaseNetworkHeader, Offset: f.addrOff + f.addrLen, Len: f.addrLen},
				&expr.Payload{DestRegister: f.regs[3], Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
				&expr.Lookup{SourceRegister: 1, SetName: f.set.Name, SetID: f.set.ID},
				&expr.Verdict{Kind: expr.VerdictDrop},
			}})
		}
		if hook.num != nftables.ChainHookInput {
			continue
		}
		for _, f := range fams {
			c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
				&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{f.nfproto}},
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: f.addrOff + f.addrLen, Len: f.addrLen},
				&expr.Lookup{SourceRegister: 1, SetName: f.addrSet.Name, SetID: f.addrSet.ID},
				&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 13, Len: 1}, // the flags
				&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{tcpSYN | tcpACK}, Xor: []byte{0}},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{tcpSYN}},
				&expr.Verdict{Kind: expr.VerdictDrop},
			}})
		}
	}
	return nil
}

// The TCP header's flags.
const (
	tcpSYN = 0x02
	tcpACK = 0x10
)

// Unguard deletes the guard table of runID in the calling thread's network
// namespace if it still exists (the restore failed before CRIU deleted it).
// A missing table is not an error.
func Unguard(ctx context.Context, runID string) error {
	if !runIDRE.MatchString(runID) {
		return fmt.Errorf("unguard: run id %q is not a CRIU run id (a UUID)", runID)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("unguard: %w", err)
	}
	t := &nftables.Table{Name: GuardTable(runID), Family: nftables.TableFamilyINet}
	if err := nftBatch(func(c *nftables.Conn) error { c.AddTable(t); c.DelTable(t); return nil }); err != nil {
		return fmt.Errorf("unguard: delete table inet %s: %w", t.Name, err)
	}
	return nil
}

// GuardExists reports whether the guard table of runID exists in the
// calling thread's network namespace.
func GuardExists(ctx context.Context, runID string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	c, err := nftables.New()
	if err != nil {
		return false, fmt.Errorf("nftables: %w", err)
	}
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		return false, fmt.Errorf("list nftables tables: %w", err)
	}
	want := GuardTable(runID)
	return slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Name == want }), nil
}

// CheckGuards reports whether the kernel can hold a restore's guard: its
// nftables answers over netlink (ftagent --check-config).
func CheckGuards() error {
	c, err := nftables.New()
	if err == nil {
		_, err = c.ListTablesOfFamily(nftables.TableFamilyINet)
	}
	if err != nil {
		return fmt.Errorf("nftables over netlink: %w: a restore guards the restored connections with an nftables table; the kernel needs CONFIG_NF_TABLES and CONFIG_NF_TABLES_INET", err)
	}
	return nil
}

// nftBatch sends what build adds as one nftables transaction over a netlink
// socket opened in the calling thread's network namespace.
func nftBatch(build func(c *nftables.Conn) error) error {
	c, err := nftables.New() // not lasting: each Flush dials from the calling thread
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	if err := build(c); err != nil {
		return err
	}
	return c.Flush()
}
