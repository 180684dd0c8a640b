package image

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/inventory"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

const (
	inventoryName = "inventory.img"
	// magicInventory is INVENTORY_MAGIC. Unlike every other image,
	// inventory.img has no leading common magic: only this word.
	magicInventory = 0x58313116
	// fieldDumpRunID is inventory_entry.dump_criu_run_id (CRIU 3.19+),
	// which go-criu v7's proto does not have: it is read from the raw
	// message.
	fieldDumpRunID protowire.Number = 13
	// maxRunIDLen bounds the run id: CRIU writes a 36-character UUID into a
	// 37-byte buffer.
	maxRunIDLen = 64
)

// NetworkLock is how CRIU locked the network during the dump, as it records
// it in inventory.img (CRIU's internal enum, not the RPC one) for the
// restore to undo the same way.
type NetworkLock uint32

const (
	NetworkLockIPTables NetworkLock = 0
	NetworkLockNFTables NetworkLock = 1
	NetworkLockSkip     NetworkLock = 2
)

func (m NetworkLock) String() string {
	switch m {
	case NetworkLockIPTables:
		return "iptables"
	case NetworkLockNFTables:
		return "nftables"
	case NetworkLockSkip:
		return "skip"
	}
	return fmt.Sprintf("network-lock-%d", uint32(m))
}

// Inventory is what a restore needs from inventory.img.
type Inventory struct {
	ImgVersion uint32
	// RunID is the dump's criu_run_id (a UUID). CRIU's nftables lock
	// table is named after it and the restore deletes the table by that
	// name; "" for dumps by CRIU older than 3.19, which name it after a PID.
	RunID string
	// NetworkLock is the dump's lock method; CRIU's default (iptables)
	// when the image does not say.
	NetworkLock NetworkLock
	TCPClose    bool
}

// ReadInventory reads dir/inventory.img.
func ReadInventory(dir string) (Inventory, error) {
	b, err := os.ReadFile(filepath.Join(dir, inventoryName))
	if err != nil {
		return Inventory{}, fmt.Errorf("read CRIU image: %w", err)
	}
	return decodeInventory(inventoryName, b)
}

func decodeInventory(name string, b []byte) (Inventory, error) {
	if len(b) < 4 {
		return Inventory{}, fmt.Errorf("image %s: %d bytes, too short for the magic: %w", name, len(b), ErrFormat)
	}
	if m := uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24; m != magicInventory {
		return Inventory{}, fmt.Errorf("image %s: magic %#x, want %#x: %w", name, m, uint32(magicInventory), ErrFormat)
	}
	payload, rest, err := nextEntry(name, b[4:], 4)
	if err != nil {
		return Inventory{}, err
	}
	if len(rest) != 0 {
		return Inventory{}, fmt.Errorf("image %s: %d bytes after the inventory entry: %w", name, len(rest), ErrFormat)
	}
	var e inventory.InventoryEntry
	if err := proto.Unmarshal(payload, &e); err != nil {
		return Inventory{}, fmt.Errorf("image %s: InventoryEntry: %v: %w", name, err, ErrFormat)
	}
	inv := Inventory{
		ImgVersion:  e.GetImgVersion(),
		NetworkLock: NetworkLock(e.GetNetworkLockMethod()),
		TCPClose:    e.GetTcpClose(),
	}
	// proto.Unmarshal kept the fields go-criu does not know as raw bytes.
	for u := e.ProtoReflect().GetUnknown(); len(u) > 0; {
		num, typ, n := protowire.ConsumeTag(u)
		if n < 0 {
			return Inventory{}, fmt.Errorf("image %s: InventoryEntry: %v: %w", name, protowire.ParseError(n), ErrFormat)
		}
		u = u[n:]
		if num == fieldDumpRunID && typ == protowire.BytesType {
			v, m := protowire.ConsumeBytes(u)
			if m < 0 {
				return Inventory{}, fmt.Errorf("image %s: field dump_criu_run_id: %v: %w", name, protowire.ParseError(m), ErrFormat)
			}
			if len(v) > maxRunIDLen {
				return Inventory{}, fmt.Errorf("image %s: field dump_criu_run_id is %d bytes, more than %d: %w", name, len(v), maxRunIDLen, ErrFormat)
			}
			inv.RunID = string(v) // the last occurrence wins, as in protobuf
			u = u[m:]
			continue
		}
		m := protowire.ConsumeFieldValue(num, typ, u)
		if m < 0 {
			return Inventory{}, fmt.Errorf("image %s: InventoryEntry field %d: %v: %w", name, num, protowire.ParseError(m), ErrFormat)
		}
		u = u[m:]
	}
	return inv, nil
}
